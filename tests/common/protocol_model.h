// A model of the cross-rank protocol of the fused passes at R > 1 (docs/expert-parallel.md), and an
// exhaustive explorer of its interleavings: every order in which R ranks' steps can run, over several
// consecutive passes (a graph replay is the same passes again). Checked: no deadlock (every rank
// finishes), and every read of another rank's buffer sees the value of its own pass (neither the
// pass before, a read before the write, nor the pass after, a write before the read).
//
// The passes alternate forward and backward (forward, backward, then their graph replay: four passes).
// What a pass is, per rank r, in the model (the steps of src/runtime/fused_passes.h):
//   forward  open:    write TOK[r] (x) and W[r] (ids, weights); arrive (one counter addition per rank)
//            compute: wait; read TOK[s] and W[s] of every rank s; write SLOT[s][r] into every rank s
//                     (slot_row); write RA[r] (rows_a); write ERR[s][r] into every rank s (its
//                     status code, published with the arrival); arrive
//            close:   wait; read ERR[r][q], RA[q] and SLOT[r][q] of every rank q
//   backward open:    write TOK[r] (dy); arrive
//            compute: wait; read TOK[s] and W[s] (the forward's weights) of every rank s; write RA[r]
//                     (the gathered dy rows, then the per-row dx: rows_b lies on rows_a) and RB[r]
//                     (d_topk_rows, the per-row d_topk_weights); write ERR[s][r] into every rank s; arrive
//            close:   wait; read ERR[r][q], RA[q] (the per-row dx), RB[q] and SLOT[r][q] (the
//                     forward's) of every rank q
// A read must see the value written in the pass it belongs to: its own pass, or for W and SLOT in
// backward, the forward's before it.
// With caller contexts (Config::caller_context) the passes may come in any order a model's step takes
// (several forwards in flight before their backwards: "FFBB", each backward taking the context of the
// latest forward not yet taken); then a forward's close step also copies SLOT[r][q] into its context
// (CTX, the rank's own memory), and a backward's open step writes W[r] again (the routing restaged),
// reads W[s] of its own pass in compute, and reads CTX, not SLOT, in close.
// Arrive adds 1 to arrivals[s][r] in every rank s's signals; wait blocks until arrivals[r][p] >=
// passed[r] + 1 for every p, then sets passed[r] to that (kernels/peer/barrier.cu). Each step is
// atomic and the model is sequentially consistent: the kernels' release/acquire pairs (the arrival's
// release after the rank's writes, the wait's acquire before its reads) are what make a step's
// writes visible to a step that the barrier orders after it.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

namespace lynx::test::protocol {

// Bugs the model can be given, to show that the explorer finds them.
enum class Bug {
  kNone,
  kNoEpochIncrement,  // a wait does not count the barrier as passed (its target never grows)
  kNoComputeArrival,  // the compute step ends without its arrival
  kCloseWithoutWait,  // the close step reads without waiting
  kNoRestage,         // caller contexts: the backward does not stage its routing again
  kNoSlotCopy,        // caller contexts: the backward reads the region's slot_row, not its context's copy
};

struct Result {
  bool ok = true;
  std::string error;        // the first violation found, with the path's last steps
  int64_t states = 0;       // distinct states explored
  int64_t transitions = 0;  // steps taken from them (edges of the state graph; each taken once)
};

class Model {
 public:
  Model(int32_t ranks, int32_t passes, Bug bug = Bug::kNone) : R_(ranks), passes_(passes), bug_(bug) {
    for (int32_t p = 1; p <= passes; ++p) order_.push_back(p % 2 == 1 ? 'F' : 'B');
    build_program();
  }
  // Caller contexts: the passes in `order` ('F' forward, 'B' backward).
  Model(int32_t ranks, const std::string& order, Bug bug = Bug::kNone)
      : R_(ranks), passes_(int32_t(order.size())), bug_(bug), caller_context_(true), order_(order) {
    build_program();
  }

  Result explore() const {
    State s0;
    s0.pc.assign(R_, 0);
    s0.arrivals.assign(R_ * R_, 0);
    s0.passed.assign(R_, 0);
    s0.tok.assign(R_, 0);
    s0.w.assign(R_, 0);
    s0.ra.assign(R_, 0);
    s0.rb.assign(R_, 0);
    s0.slot.assign(R_ * R_, 0);
    s0.err.assign(R_ * R_, 0);
    s0.ctx.assign(R_ * (passes_ + 1) * R_, 0);
    Result res;
    std::unordered_set<std::string> seen;
    std::vector<State> stack{s0};
    seen.insert(key(s0));
    while (!stack.empty() && res.ok) {
      const State s = stack.back();
      stack.pop_back();
      bool any = false, done = true;
      for (int32_t r = 0; r < R_; ++r) {
        if (s.pc[r] == int32_t(program_.size())) continue;
        done = false;
        State n = s;
        std::string violation;
        if (!step(n, r, violation)) continue;  // blocked
        any = true;
        ++res.transitions;
        if (!violation.empty()) {
          res.ok = false;
          res.error = violation;
          break;
        }
        const std::string k = key(n);
        if (seen.insert(k).second) stack.push_back(std::move(n));
      }
      if (res.ok && !done && !any) {
        res.ok = false;
        res.error = "deadlock: every unfinished rank waits (" + describe(s) + ")";
      }
    }
    res.states = int64_t(seen.size());
    return res;
  }

 private:
  enum class Op { kWriteTok, kWriteW, kArrive, kWait, kReadTok, kReadW, kWriteSlot, kWriteRa, kWriteRb, kWriteErr,
                  kReadRa, kReadRb, kReadSlot, kReadErr, kCopySlot, kReadCtx };
  struct Instr {
    Op op;
    int32_t peer;    // the rank a per-rank step addresses (-1: none)
    int32_t pass;    // 1-based
    int32_t expect;  // reads: the pass whose value they must see
  };
  struct State {
    std::vector<int32_t> pc, arrivals, passed, tok, w, ra, rb, slot, err;  // arrivals, slot, err: [s * R + r]
    std::vector<int32_t> ctx;  // [(r * (passes + 1) + forward) * R + q]: rank r's context copy of SLOT[r][q]
  };

  void build_program() {
    std::vector<int32_t> open_forwards;  // caller contexts: the forwards whose backward is still to come
    for (int32_t p = 1; p <= passes_; ++p) {
      const bool forward = order_[p - 1] == 'F';
      int32_t fwd = forward ? p : p - 1;  // the forward whose W and SLOT this pass reads
      if (caller_context_ && forward) open_forwards.push_back(p);
      if (caller_context_ && !forward) {
        fwd = open_forwards.back();
        open_forwards.pop_back();
      }
      // With caller contexts a backward stages its routing again, and reads its own pass's W.
      const bool restage = caller_context_ && !forward && bug_ != Bug::kNoRestage;
      const auto each = [&](Op op, int32_t expect) {
        for (int32_t s = 0; s < R_; ++s) program_.push_back({op, s, p, expect});
      };
      program_.push_back({Op::kWriteTok, -1, p, 0});
      if (forward || restage) program_.push_back({Op::kWriteW, -1, p, 0});
      each(Op::kArrive, 0);
      program_.push_back({Op::kWait, -1, p, 0});
      each(Op::kReadTok, p);
      each(Op::kReadW, caller_context_ && !forward ? p : fwd);
      if (forward) each(Op::kWriteSlot, 0);
      program_.push_back({Op::kWriteRa, -1, p, 0});
      if (!forward) program_.push_back({Op::kWriteRb, -1, p, 0});
      each(Op::kWriteErr, 0);
      if (bug_ != Bug::kNoComputeArrival) each(Op::kArrive, 0);
      if (bug_ != Bug::kCloseWithoutWait) program_.push_back({Op::kWait, -1, p, 0});
      each(Op::kReadErr, p);
      each(Op::kReadRa, p);
      if (!forward) each(Op::kReadRb, p);
      if (caller_context_ && forward) {
        each(Op::kCopySlot, p);
      } else if (caller_context_ && bug_ != Bug::kNoSlotCopy) {
        each(Op::kReadCtx, fwd);
      } else {
        each(Op::kReadSlot, fwd);
      }
    }
  }

  static void check_read(int32_t seen, const Instr& in, int32_t reader, const char* what, std::string& violation) {
    if (seen == in.expect) return;
    violation = std::string(what) + " of rank " + std::to_string(in.peer) + " read by rank " + std::to_string(reader) +
                " in pass " + std::to_string(in.pass) + " holds pass " + std::to_string(seen) + "'s value, not pass " +
                std::to_string(in.expect) + "'s (" + (seen < in.expect ? "read before its write" : "overwritten before the read") +
                ")";
  }

  // Runs rank r's next step on s: false when it is blocked; `violation` set when it breaks a rule.
  bool step(State& s, int32_t r, std::string& violation) const {
    const Instr& in = program_[s.pc[r]];
    switch (in.op) {
      case Op::kWriteTok:
        s.tok[r] = in.pass;
        break;
      case Op::kWriteW:
        s.w[r] = in.pass;
        break;
      case Op::kArrive:
        ++s.arrivals[in.peer * R_ + r];
        break;
      case Op::kWait: {
        const int32_t target = s.passed[r] + 1;
        for (int32_t p = 0; p < R_; ++p) {
          if (s.arrivals[r * R_ + p] < target) return false;
        }
        if (bug_ != Bug::kNoEpochIncrement) s.passed[r] = target;
        break;
      }
      case Op::kWriteSlot:
        s.slot[in.peer * R_ + r] = in.pass;
        break;
      case Op::kWriteRa:
        s.ra[r] = in.pass;
        break;
      case Op::kWriteRb:
        s.rb[r] = in.pass;
        break;
      case Op::kWriteErr:
        s.err[in.peer * R_ + r] = in.pass;
        break;
      case Op::kReadErr:
        check_read(s.err[r * R_ + in.peer], in, r, "ERR (the status code it published)", violation);
        break;
      case Op::kReadTok:
        check_read(s.tok[in.peer], in, r, "TOK (token rows)", violation);
        break;
      case Op::kReadW:
        check_read(s.w[in.peer], in, r, "W (ids, weights)", violation);
        break;
      case Op::kReadRa:
        check_read(s.ra[in.peer], in, r, "RA (rows_a: expert outputs, or rows_b on them: per-row dx)", violation);
        break;
      case Op::kReadRb:
        check_read(s.rb[in.peer], in, r, "RB (d_topk_rows: per-row d_topk_weights)", violation);
        break;
      case Op::kReadSlot:
        check_read(s.slot[r * R_ + in.peer], in, r, "SLOT (slot_row entries it wrote)", violation);
        break;
      case Op::kCopySlot:  // the forward's close: SLOT read (checked) into the context
        check_read(s.slot[r * R_ + in.peer], in, r, "SLOT (slot_row entries it wrote)", violation);
        s.ctx[(r * (passes_ + 1) + in.pass) * R_ + in.peer] = s.slot[r * R_ + in.peer];
        break;
      case Op::kReadCtx:  // the backward's close: the copy its forward's context holds
        check_read(s.ctx[(r * (passes_ + 1) + in.expect) * R_ + in.peer], in, r,
                   "SLOT (as its forward's context copied it)", violation);
        break;
    }
    ++s.pc[r];
    return true;
  }

  static std::string key(const State& s) {
    std::string k;
    for (const auto* v : {&s.pc, &s.arrivals, &s.passed, &s.tok, &s.w, &s.ra, &s.rb, &s.slot, &s.err, &s.ctx}) {
      for (int32_t x : *v) k.push_back(char(x));
      k.push_back('|');
    }
    return k;
  }

  std::string describe(const State& s) const {
    std::string d;
    for (int32_t r = 0; r < R_; ++r) {
      d += "rank " + std::to_string(r) + " at step " + std::to_string(s.pc[r]) + " of " +
           std::to_string(program_.size()) + ", passed " + std::to_string(s.passed[r]) + "; ";
    }
    return d;
  }

  int32_t R_, passes_;
  Bug bug_;
  bool caller_context_ = false;
  std::string order_;  // 'F' or 'B' per pass
  std::vector<Instr> program_;
};

}  // namespace lynx::test::protocol
