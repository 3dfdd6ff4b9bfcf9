// lynx-bench's --json file (bench/results_json.h): whole and parseable after every row, "complete" only
// after close, nothing for an empty path, an unwritable path refused at once.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "lynx/error.h"
#include "results_json.h"

namespace lynx::bench {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string temp_path(const char* name) { return ::testing::TempDir() + name; }

const char* const kHead =
    "{\n  \"date\": \"2026-12-05\",\n  \"gpu\": \"G\",\n  \"commit\": \"c\",\n  \"command\": \"lynx-bench \\\"x\\\"\",\n"
    "  \"results\": [";

TEST(BenchResultsJson, WholeAfterEveryRowAndCompleteOnlyAfterClose) {
  const std::string path = temp_path("lynx_results_json_rows.json");
  ResultsJson json(path, "2026-12-05", "G", "c", "lynx-bench \"x\"");
  ASSERT_TRUE(json.enabled());
  EXPECT_EQ(read_file(path), std::string(kHead) + "\n  ],\n  \"complete\": false\n}\n");
  json.row() << "{\"ms\": " << 1.5 << "}";
  EXPECT_EQ(read_file(path), std::string(kHead) + "\n    {\"ms\": 1.5}\n  ],\n  \"complete\": false\n}\n");
  {
    ResultsJson::Row row = json.row();
    row << "{\"ms\": 2";
    row << "}";
    // Not yet in the file while it is being written.
    EXPECT_EQ(read_file(path).find("\"ms\": 2}"), std::string::npos);
  }
  EXPECT_EQ(read_file(path),
            std::string(kHead) + "\n    {\"ms\": 1.5},\n    {\"ms\": 2}\n  ],\n  \"complete\": false\n}\n");
  json.close();
  EXPECT_EQ(read_file(path),
            std::string(kHead) + "\n    {\"ms\": 1.5},\n    {\"ms\": 2}\n  ],\n  \"complete\": true\n}\n");
  EXPECT_FALSE(std::ifstream(path + ".tmp").good()) << "the temporary file is renamed over the file";
  std::remove(path.c_str());
}

TEST(BenchResultsJson, NoPathWritesNothing) {
  ResultsJson json("", "d", "g", "c", "x");
  EXPECT_FALSE(json.enabled());
  json.row() << "{}";
  json.close();
}

TEST(BenchResultsJson, UnwritablePathIsRefusedAtOnce) {
  EXPECT_THROW(ResultsJson(temp_path("no-such-folder/r.json"), "d", "g", "c", "x"), Error);
}

TEST(BenchResultsJson, StringsAreEscaped) { EXPECT_EQ(json_string("a\"b\\c"), "\"a\\\"b\\\\c\""); }

}  // namespace
}  // namespace lynx::bench
