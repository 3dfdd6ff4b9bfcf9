// The cross-rank protocol (docs/expert-parallel.md) checked exhaustively over every interleaving of R
// = 2, 3 and 4 ranks for four consecutive passes (a forward and a backward, then a graph replay of both),
// and with caller contexts for several forwards in flight before their backwards: no deadlock, no read
// of another rank's buffer before its write or after its next write. Each seeded bug is found.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "common/protocol_model.h"

namespace lynx::test::protocol {
namespace {

// The explorer's size for one configuration, printed (docs/testing.md records it) and kept in the XML.
void report(int32_t ranks, int32_t passes, const Result& r) {
  std::printf("protocol model R = %d, %d passes: %lld distinct states, %lld transitions\n", ranks, passes,
              static_cast<long long>(r.states), static_cast<long long>(r.transitions));
  testing::Test::RecordProperty("states", std::to_string(r.states));
  testing::Test::RecordProperty("transitions", std::to_string(r.transitions));
}

// More states than one rank's steps times R: the explorer went through more than one interleaving.
TEST(ProtocolModel, TwoRanksFourPassesHold) {
  const Result r = Model(2, 4).explore();
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_GT(r.states, 2 * 4 * 20);
  report(2, 4, r);
}

TEST(ProtocolModel, ThreeRanksFourPassesHold) {
  const Result r = Model(3, 4).explore();
  EXPECT_TRUE(r.ok) << r.error;
  EXPECT_GT(r.states, 3 * 4 * 26);
  report(3, 4, r);
}

TEST(ProtocolModel, FourRanksFourPassesHold) {
  const Result r = Model(4, 4).explore();
  EXPECT_TRUE(r.ok) << r.error;
  report(4, 4, r);
}

TEST(ProtocolModel, MissingEpochIncrementIsFound) {
  const Result r = Model(2, 2, Bug::kNoEpochIncrement).explore();
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("before"), std::string::npos) << r.error;
}

TEST(ProtocolModel, MissingArrivalIsADeadlock) {
  const Result r = Model(2, 2, Bug::kNoComputeArrival).explore();
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("deadlock"), std::string::npos) << r.error;
}

TEST(ProtocolModel, CloseWithoutWaitReadsTooEarly) {
  const Result r = Model(3, 2, Bug::kCloseWithoutWait).explore();
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("read before its write"), std::string::npos) << r.error;
}

// Caller contexts: two and three forwards in flight before their backwards, and a forward between a
// forward and its backward.
TEST(ProtocolModel, CallerContextsHold) {
  for (const char* order : {"FFBB", "FBFB", "FFBFBB"}) {
    for (const int32_t R : {2, 3}) {
      const Result r = Model(R, order).explore();
      EXPECT_TRUE(r.ok) << order << " at R = " << R << ": " << r.error;
    }
  }
  const Result r = Model(2, "FFFBBB").explore();
  EXPECT_TRUE(r.ok) << r.error;
  report(2, 6, r);
}

// Without staging the routing again, a backward reads the later forward's weights; reading the region's
// slot_row instead of the context's copy, the later forward's rows.
TEST(ProtocolModel, CallerContextBugsAreFound) {
  Result r = Model(2, "FFBB", Bug::kNoRestage).explore();
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("W (ids, weights)"), std::string::npos) << r.error;
  r = Model(2, "FFBB", Bug::kNoSlotCopy).explore();
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("SLOT"), std::string::npos) << r.error;
  EXPECT_TRUE(Model(2, "FBFB", Bug::kNoSlotCopy).explore().ok) << "one forward at a time needs no copy";
}

}  // namespace
}  // namespace lynx::test::protocol
