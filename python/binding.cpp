// lynx._C: the C++ API for Python, as thin as possible. Tensors cross as (data_ptr, dtype code, shape,
// strides) tuples built by lynx/_views.py; streams as integers (torch's cuda_stream).
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "lynx/lynx.h"

namespace py = pybind11;

namespace {

lynx::TensorView to_view(const py::handle& h, const char* name) {
  if (h.is_none()) return {};
  const auto t = h.cast<py::tuple>();
  if (t.size() != 4) throw lynx::Error(name, "internal: a tensor crosses as (ptr, dtype, shape, strides)");
  lynx::TensorView v;
  v.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  v.dtype = static_cast<lynx::DType>(t[1].cast<int>());
  const auto shape = t[2].cast<std::vector<int64_t>>();
  const auto strides = t[3].cast<std::vector<int64_t>>();
  if (shape.size() > size_t(lynx::kMaxTensorRank) || shape.size() != strides.size()) {
    throw lynx::Error(name, "has " + std::to_string(shape.size()) + " dimensions; lynx takes at most " +
                                std::to_string(lynx::kMaxTensorRank));
  }
  v.rank = static_cast<int32_t>(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    v.shape[d] = shape[d];
    v.strides[d] = strides[d];
  }
  return v;
}

// (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
lynx::LayerInputs to_inputs(const py::tuple& t) {
  if (t.size() != 9) throw lynx::Error("inputs", "internal: expected 9 tensors");
  lynx::LayerInputs in;
  in.x = to_view(t[0], "x");
  in.topk_ids = to_view(t[1], "topk_ids");
  in.topk_weights = to_view(t[2], "topk_weights");
  in.weights.w_gate = to_view(t[3], "w_gate");
  in.weights.w_up = to_view(t[4], "w_up");
  in.weights.w_down = to_view(t[5], "w_down");
  in.weights.ws_gate = to_view(t[6], "ws_gate");
  in.weights.ws_up = to_view(t[7], "ws_up");
  in.weights.ws_down = to_view(t[8], "ws_down");
  return in;
}

// (dx, d_topk_weights, dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down)
lynx::Gradients to_gradients(const py::tuple& t) {
  if (t.size() != 8) throw lynx::Error("gradients", "internal: expected 8 tensors");
  lynx::Gradients g;
  g.dx = to_view(t[0], "dx");
  g.d_topk_weights = to_view(t[1], "d_topk_weights");
  g.dw_gate = to_view(t[2], "dw_gate");
  g.dw_up = to_view(t[3], "dw_up");
  g.dw_down = to_view(t[4], "dw_down");
  g.dws_gate = to_view(t[5], "dws_gate");
  g.dws_up = to_view(t[6], "dws_up");
  g.dws_down = to_view(t[7], "dws_down");
  return g;
}

cudaStream_t to_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

lynx::LayerShape layer_shape(int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                             int64_t shared_intermediate, int num_ranks, int rank) {
  lynx::LayerShape s;
  s.tokens = tokens;
  s.hidden = hidden;
  s.intermediate = intermediate;
  s.num_experts = num_experts;
  s.top_k = top_k;
  s.shared_intermediate = shared_intermediate;
  s.num_ranks = num_ranks;
  s.rank = rank;
  return s;
}

// Scratch from two Python callables, alloc(nbytes, stream) -> pointer and free(pointer, nbytes, stream)
// (lynx/_workspaces.py passes torch's caching allocator). A call reaches them with the GIL released
// (forward, backward): each takes it back.
class PyScratchAllocator final : public lynx::ScratchAllocator {
 public:
  PyScratchAllocator(py::function alloc, py::function free) : alloc_(std::move(alloc)), free_(std::move(free)) {}
  void* allocate(size_t bytes, cudaStream_t stream) override {
    py::gil_scoped_acquire gil;
    return reinterpret_cast<void*>(alloc_(bytes, reinterpret_cast<uintptr_t>(stream)).cast<uintptr_t>());
  }
  void deallocate(void* p, size_t bytes, cudaStream_t stream) override {
    py::gil_scoped_acquire gil;
    try {
      free_(reinterpret_cast<uintptr_t>(p), bytes, reinterpret_cast<uintptr_t>(stream));
    } catch (const py::error_already_set&) {
    }
  }

 private:
  py::function alloc_, free_;
};

// NOTES: never destroyed: workspaces hold a pointer to it until the interpreter exits, after which a
// py::function may no longer be released.
PyScratchAllocator* scratch_allocator = nullptr;

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "lynx C++ API (use lynx.functional / lynx.nn instead)";
  py::register_exception<lynx::Error>(m, "LynxError", PyExc_ValueError);
  m.def("set_scratch_allocator", [](py::function alloc, py::function free) {
    if (scratch_allocator != nullptr) throw lynx::Error("scratch_allocator", "internal: set once per process");
    scratch_allocator = new PyScratchAllocator(std::move(alloc), std::move(free));
  });

  // NOTES: dynamic attributes: lynx/ops.py records on the workspace which weights its FP8 copies are of.
  py::class_<lynx::Workspace>(m, "Workspace", py::dynamic_attr())
      .def(py::init([](int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
                       int64_t shared_intermediate, int backend, int64_t schedule_capacity, bool save_forward_context,
                       bool scratch_from_allocator, bool caller_context, int num_ranks, int rank,
                       int64_t peer_timeout_ms, int precision, lynx::Workspace* fp8_weights_of) {
             const lynx::LayerShape s =
                 layer_shape(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, num_ranks, rank);
             lynx::Config c;
             c.backend = static_cast<lynx::Backend>(backend);
             c.schedule_capacity = schedule_capacity;
             c.save_forward_context = save_forward_context;
             c.caller_context = caller_context;
             c.peer_timeout_ms = peer_timeout_ms;
             // lynx/_workspaces.py's codes: lynx::Precision, and 2 for kFp8Block with bf16 weight gradients.
             c.precision = static_cast<lynx::Precision>(precision == 2 ? 1 : precision);
             c.bf16_weight_grads = precision == 2;
             if (scratch_from_allocator) {
               if (scratch_allocator == nullptr) throw lynx::Error("scratch_allocator", "internal: not set");
               c.scratch_allocator = scratch_allocator;
             }
             if (fp8_weights_of != nullptr) return new lynx::Workspace(s, c, *fp8_weights_of);
             return new lynx::Workspace(s, c);
           }),
           py::arg("tokens"), py::arg("hidden"), py::arg("intermediate"), py::arg("num_experts"), py::arg("top_k"),
           py::arg("shared_intermediate"), py::arg("backend"), py::arg("schedule_capacity"),
           py::arg("save_forward_context"), py::arg("scratch_from_allocator") = false,
           py::arg("caller_context") = false, py::arg("num_ranks") = 1, py::arg("rank") = 0,
           py::arg("peer_timeout_ms") = 0, py::arg("precision") = 0,
           py::arg("fp8_weights_of") = static_cast<lynx::Workspace*>(nullptr))
      .def("device_bytes", &lynx::Workspace::device_bytes)
      .def("scratch_bytes", &lynx::Workspace::scratch_bytes)
      .def("context_bytes", &lynx::Workspace::context_bytes)
      .def("schedule_arrays",
           [](const lynx::Workspace& ws) {
             // (name, device pointer, int32 elements) of each array of lynx::Schedule.
             const lynx::Schedule s = ws.schedule();
             const lynx::LayerShape& shape = ws.shape();
             const auto at = [](const int32_t* p) { return reinterpret_cast<uintptr_t>(p); };
             return py::make_tuple(
                 py::make_tuple("row_token_slot", at(s.row_token_slot), s.capacity),
                 py::make_tuple("row_src_rank", at(s.row_src_rank), s.capacity),
                 py::make_tuple("expert_offset", at(s.expert_offset), s.local_experts + 1),
                 py::make_tuple("expert_rows", at(s.expert_rows), s.local_experts),
                 py::make_tuple("slot_row", at(s.slot_row), shape.tokens * shape.top_k));
           })
      .def("has_context_for", [](const lynx::Workspace& ws, const py::tuple& in) { return ws.has_context_for(to_inputs(in)); })
      .def("check", [](const lynx::Workspace& ws, uintptr_t stream) {
        py::gil_scoped_release release;
        ws.check(to_stream(stream));
      });

  // Host-side argument checks (lynx::validate_inputs, validate_gradients) that lynx/ops.py makes before a
  // call looks up its workspace or queues anything (the FP8 weights' quantisation among them).
  m.def("validate_inputs", [](int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts,
                              int64_t top_k, int64_t shared_intermediate, int num_ranks, const py::tuple& in) {
    lynx::validate_inputs(
        layer_shape(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, num_ranks, 0),
        to_inputs(in));
  });
  m.def("validate_gradients", [](int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts,
                                 int64_t top_k, int64_t shared_intermediate, int num_ranks, const py::handle& dy,
                                 const py::tuple& grads) {
    lynx::validate_gradients(
        layer_shape(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, num_ranks, 0),
        to_view(dy, "dy"), to_gradients(grads));
  });
  m.def("schedule_capacity_for_load", [](int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts,
                                          int64_t top_k, int64_t shared_intermediate, int num_ranks, double max_load) {
    return lynx::schedule_capacity_for_load(
        layer_shape(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, num_ranks, 0), max_load);
  });
  // Expert parallelism, one process per rank: all_gather(bytes) -> [bytes of every rank] (lynx/_groups.py
  // passes torch.distributed's all_gather_object over the caller's group). Called with the GIL held.
  m.def("connect_process_group", [](lynx::Workspace& ws, py::function all_gather) {
    lynx::connect_process_group(ws, [&](const std::vector<uint8_t>& mine) {
      const py::list all = all_gather(py::bytes(reinterpret_cast<const char*>(mine.data()), mine.size()));
      std::vector<std::vector<uint8_t>> out;
      for (const py::handle& b : all) {
        const std::string bytes = b.cast<std::string>();
        out.emplace_back(bytes.begin(), bytes.end());
      }
      return out;
    });
  });
  m.def(
      "forward_context_bytes",
      [](int64_t tokens, int64_t hidden, int64_t intermediate, int64_t num_experts, int64_t top_k,
         int64_t shared_intermediate, int backend, int64_t schedule_capacity, int num_ranks) {
        lynx::Config c;
        c.backend = static_cast<lynx::Backend>(backend);
        c.schedule_capacity = schedule_capacity;
        return lynx::forward_context_bytes(
            layer_shape(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, num_ranks, 0), c);
      },
      py::arg("tokens"), py::arg("hidden"), py::arg("intermediate"), py::arg("num_experts"), py::arg("top_k"),
      py::arg("shared_intermediate"), py::arg("backend"), py::arg("schedule_capacity"), py::arg("num_ranks") = 1);
  // forward and backward with the context in a caller's block (a tensor autograd saves).
  m.def("forward_into", [](lynx::Workspace& ws, const py::tuple& in, const py::handle& y, uintptr_t context,
                           int64_t context_bytes, uintptr_t stream) {
    const lynx::LayerInputs inputs = to_inputs(in);
    const lynx::TensorView out = to_view(y, "y");
    lynx::ForwardContext ctx;
    ctx.data = reinterpret_cast<void*>(context);
    ctx.bytes = context_bytes;
    py::gil_scoped_release release;
    lynx::forward(ws, inputs, out, ctx, to_stream(stream));
  });
  m.def("backward_from", [](lynx::Workspace& ws, const py::tuple& in, const py::handle& dy, const py::tuple& grads,
                            uintptr_t context, int64_t context_bytes, uintptr_t stream) {
    const lynx::LayerInputs inputs = to_inputs(in);
    const lynx::TensorView d = to_view(dy, "dy");
    const lynx::Gradients g = to_gradients(grads);
    // NOTES: the context was filled by forward_into from these inputs: autograd saved them with it and
    // checks their version counters, so the host key is theirs (a tensor offloaded and brought back
    // has a new address, and the context itself holds no address).
    lynx::ForwardContext ctx;
    ctx.data = reinterpret_cast<void*>(context);
    ctx.bytes = context_bytes;
    const void* key[7] = {inputs.x.data,              inputs.topk_ids.data,      inputs.topk_weights.data,
                          inputs.weights.w_gate.data, inputs.weights.w_up.data,  inputs.weights.ws_gate.data,
                          inputs.weights.ws_up.data};
    for (int i = 0; i < 7; ++i) ctx.inputs[i] = key[i];
    ctx.valid = true;
    ctx.layout = ws.context_layout();  // filled by this workspace's forward_into (ops.py looks it up alike)
    py::gil_scoped_release release;
    lynx::backward(ws, inputs, d, g, ctx, to_stream(stream));
  });
  m.def("forward", [](lynx::Workspace& ws, const py::tuple& in, const py::handle& y, uintptr_t stream) {
    const lynx::LayerInputs inputs = to_inputs(in);
    const lynx::TensorView out = to_view(y, "y");
    py::gil_scoped_release release;
    lynx::forward(ws, inputs, out, to_stream(stream));
  });
  // copies: lynx::Fp8Copies (0 both, 1 the forward's, 2 the backward's)
  m.def("quantize_weights", [](lynx::Workspace& ws, const py::tuple& in, uintptr_t stream, int copies) {
    const lynx::LayerInputs inputs = to_inputs(in);
    py::gil_scoped_release release;
    lynx::quantize_weights(ws, inputs.weights, to_stream(stream), lynx::Fp8Copies(copies));
  });
  // (w_gate, w_up, w_down, w_gate_scales, w_up_scales, w_down_scales)
  m.def("set_quantized_weights", [](lynx::Workspace& ws, const py::tuple& t, uintptr_t stream) {
    if (t.size() != 6) throw lynx::Error("weights", "internal: expected 6 tensors");
    lynx::Fp8ExpertWeights f;
    f.w_gate = to_view(t[0], "w_gate");
    f.w_up = to_view(t[1], "w_up");
    f.w_down = to_view(t[2], "w_down");
    f.w_gate_scales = to_view(t[3], "w_gate_scales");
    f.w_up_scales = to_view(t[4], "w_up_scales");
    f.w_down_scales = to_view(t[5], "w_down_scales");
    py::gil_scoped_release release;
    lynx::set_quantized_weights(ws, f, to_stream(stream));
  });
  m.def("share_quantized_weights", [](lynx::Workspace& from, lynx::Workspace& to) {
    py::gil_scoped_release release;
    lynx::share_quantized_weights(from, to);
  });
  m.def("recompute_forward_context", [](lynx::Workspace& ws, const py::tuple& in, uintptr_t stream) {
    const lynx::LayerInputs inputs = to_inputs(in);
    py::gil_scoped_release release;
    lynx::recompute_forward_context(ws, inputs, to_stream(stream));
  });
  m.def("backward", [](lynx::Workspace& ws, const py::tuple& in, const py::handle& dy, const py::tuple& grads,
                       uintptr_t stream) {
    const lynx::LayerInputs inputs = to_inputs(in);
    const lynx::TensorView d = to_view(dy, "dy");
    const lynx::Gradients g = to_gradients(grads);
    py::gil_scoped_release release;
    lynx::backward(ws, inputs, d, g, to_stream(stream));
  });
}
