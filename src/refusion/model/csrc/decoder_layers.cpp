// The decoder layers of a compact forward (refusion/model/compact.py) as one C++ call: the same ATen operations,
// in the same order and with the same dtypes, as the Python layer loop calls them, without the interpreter between
// them. Loaded by refusion/model/native.py, which documents what it runs and when; each function below names the
// Python it mirrors. A change to either side must keep the two bit for bit equal (tests/model/test_native.py).

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

using at::Tensor;

namespace {

// kinds of product (native.py KINDS)
constexpr int64_t kPlain = 0;   // F.linear on the weight as it is
constexpr int64_t kPacked = 1;  // row_exact.PackedLinear: the oneDNN-packed bf16 weight, chunks of exact rows
constexpr int64_t kInt4 = 2;    // int4.Int4Linear: the 4-bit blocks

// A mask-gated adapter's update, added at the mask rows to one member's columns (gated_lora.MaskGatedLoRA).
struct Update {
  int64_t part;  // which member of the product's output
  Tensor a;      // [in, r] fp32
  Tensor b;      // [r, out] fp32, scaled
};

// One kernel call over the members' stacked weights (model/fused.py FusedProduct), or a lone linear layer.
struct Product {
  int64_t kind;
  Tensor weight;                // plain weight, packed weight or 4-bit blocks
  Tensor scales;                // int4: the blocks' scales and zeros
  c10::optional<Tensor> bias;
  int64_t rows;                 // packed: rows per exact chunk
  int64_t group;                // int4: weights per block
  std::vector<int64_t> splits;  // the members' output features
  std::vector<Update> updates;
};

struct Norm {
  Tensor weight;
  double eps;
};

// attention implementations (native.py ATTENTIONS)
constexpr int64_t kExact = 0;  // row_exact.exact_attention
constexpr int64_t kSdpa = 1;   // transformers' sdpa_attention_forward (on a CPU)

struct Layer {
  Norm input, post;
  c10::optional<Norm> q_norm, k_norm;  // Qwen3
  std::vector<Product> qkv;            // one fused product, or q, k, v
  Product o;
  std::vector<Product> gate_up;        // one fused product, or gate, up
  Product down;
  int64_t head_dim;
  double scaling;
  int64_t attention;  // kExact or kSdpa
  int64_t kv_groups;  // query heads per KV head
};

// Where the forward's mask rows are (gated_lora.MaskRows), as the adapter's updates read them.
struct MaskRows {
  bool active;  // a mask row is in the forward: the updates apply
  bool gated;   // every row times the 0/1 gate, else the listed rows only
  c10::optional<Tensor> dense;
  c10::optional<Tensor> rows;
};

// row_exact.packed_product
Tensor packed_product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// MaskGatedLoRA.add_update
void add_update(const Update& u, const Tensor& x, const Tensor& out, const MaskRows& m) {
  Tensor flat_x = x.reshape({-1, x.size(-1)});
  Tensor flat_out = out.view({-1, out.size(-1)});
  if (m.gated) {
    Tensor low = at::mm(flat_x.to(u.a.scalar_type()), u.a).mul_(m.dense->reshape({-1, 1}));
    if (flat_out.scalar_type() == low.scalar_type()) {
      flat_out.addmm_(low, u.b);
    } else {
      flat_out.add_(at::mm(low, u.b).to(flat_out.scalar_type()));
    }
  } else {
    Tensor low = at::mm(flat_x.index_select(0, *m.rows).to(u.a.scalar_type()), u.a);
    flat_out.index_add_(0, *m.rows, at::mm(low, u.b).to(flat_out.scalar_type()));
  }
}

// FusedProduct.__call__, PackedLinear.forward (chunked_product), Int4Linear.forward, nn.Linear.forward, and the
// MaskGatedLoRA updates of the members: the members' outputs in order (views of `*whole`, when asked for)
std::vector<Tensor> product(const Product& p, const Tensor& x, const MaskRows& m, Tensor* whole = nullptr) {
  Tensor out;
  if (p.kind == kPlain) {
    out = at::linear(x, p.weight, p.bias);
  } else {
    Tensor flat = x.reshape({-1, x.size(-1)});
    if (p.kind == kPacked) {
      if (flat.size(0) <= p.rows) {
        out = packed_product(flat, p.weight, p.bias);
      } else {
        std::vector<Tensor> chunks;
        for (const Tensor& chunk : flat.split(p.rows)) chunks.push_back(packed_product(chunk, p.weight, p.bias));
        out = at::cat(chunks);
      }
    } else {
      out = at::_weight_int4pack_mm_for_cpu(flat.contiguous(), p.weight, p.group, p.scales);
      if (p.bias) out = out + *p.bias;
    }
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out.size(-1);
    out = out.view(shape);
  }
  std::vector<Tensor> parts = p.splits.size() == 1 ? std::vector<Tensor>{out} : out.split_with_sizes(p.splits, -1);
  if (m.active) {
    for (const Update& u : p.updates) add_update(u, x, parts[u.part], m);
  }
  if (whole != nullptr) *whole = out;
  return parts;
}

// the members' outputs of a block's products, in order
std::vector<Tensor> products(const std::vector<Product>& ps, const Tensor& x, const MaskRows& m) {
  std::vector<Tensor> outs;
  for (const Product& p : ps) {
    for (Tensor& part : product(p, x, m)) outs.push_back(std::move(part));
  }
  return outs;
}

// LlamaRMSNorm.forward (Mistral, Qwen2, Qwen3 alike)
Tensor rms_norm(const Tensor& x, const Norm& norm) {
  auto dtype = x.scalar_type();
  Tensor h = x.to(at::kFloat);
  Tensor variance = h.pow(2).mean(-1, true);
  h = h * at::rsqrt(variance + norm.eps);
  return norm.weight * h.to(dtype);
}

// rotate_half
Tensor rotate_half(const Tensor& x) {
  int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// row_exact.exact_attention
Tensor exact_attention(const Tensor& query, const Tensor& key, const Tensor& value, const c10::optional<Tensor>& mask,
                       double scaling) {
  int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  int64_t kv_heads = key.size(1), length = key.size(2);
  Tensor grouped = query.reshape({batch, kv_heads, heads / kv_heads * rows, dim}).to(at::kDouble);
  Tensor scores =
      at::matmul(grouped, key.to(at::kDouble).transpose(2, 3)).view({batch, heads, rows, length}).mul_(scaling);
  if (mask) scores.add_(mask->slice(3, 0, length));
  Tensor weights = at::softmax(scores, -1, at::kFloat).to(query.scalar_type());
  Tensor out = at::matmul(weights.view({batch, kv_heads, -1, length}).to(at::kDouble), value.to(at::kDouble));
  out = out.view({batch, heads, rows, dim}).to(query.scalar_type());
  return out.transpose(1, 2).contiguous();
}

// repeat_kv
Tensor repeat_kv(const Tensor& x, int64_t repeats) {
  if (repeats == 1) return x;
  int64_t batch = x.size(0), kv_heads = x.size(1), length = x.size(2), dim = x.size(3);
  return x.unsqueeze(2).expand({batch, kv_heads, repeats, length, dim}).reshape({batch, kv_heads * repeats, length, dim});
}

// pack_gqa
c10::optional<Tensor> pack_gqa(const c10::optional<Tensor>& x, int64_t repeats) {
  if (!x || x->size(1) == 1) return x;
  return x->reshape({x->size(0), x->size(1) / repeats, repeats, x->size(3)});
}

// sdpa_attention_forward on a CPU (no position bias, no dropout, causal module, TRANSFORMERS_SDPA_FORCE_GQA unset)
Tensor sdpa_attention(Tensor query, Tensor key, Tensor value, c10::optional<Tensor> mask, double scaling,
                      int64_t groups) {
  int64_t rows = query.size(2);
  bool gqa = false;
  if (groups > 1) {
    if (!mask && key.size(-1) == value.size(-1) && key.size(-1) <= 256) {  // use_gqa_in_sdpa
      gqa = true;
    } else if (rows == 1) {
      query = *pack_gqa(query, groups);
      mask = pack_gqa(mask, groups);
    } else {
      key = repeat_kv(key, groups);
      value = repeat_kv(value, groups);
    }
  }
  bool causal = rows > 1 && !mask;
  if (causal && key.size(2) > rows) {
    key = key.slice(2, 0, rows);
    value = value.slice(2, 0, rows);
  }
  Tensor out = at::scaled_dot_product_attention(query, key, value, mask, 0.0, causal, scaling, gqa);
  out = out.reshape({out.size(0), -1, rows, value.size(-1)});
  return out.transpose(1, 2).contiguous();
}

// apply_rotary_pos_emb's formula for one of q and k; c, s: cos and sin unsqueezed at dim 1
Tensor rotary(const Tensor& x, const Tensor& c, const Tensor& s) {
  return (x * c) + (rotate_half(x) * s);
}

// CompactForward._attention with apply_rotary_pos_emb, SlotCache.write (native.py: `SlotCache.native_storage`) and
// the model's attention function.
// Where q and k are adjacent columns of one fused product and no per-head norm comes between (Llama, Mistral,
// Qwen2), RoPE runs once over both: every element gets the same operations on the same numbers as in two calls.
Tensor attention(const Layer& layer, const Tensor& hidden, const Tensor& c, const Tensor& s,
                 const c10::optional<Tensor>& mask, Tensor& keys, Tensor& values, int64_t start, const MaskRows& m) {
  int64_t batch = hidden.size(0), width = hidden.size(1), dim = layer.head_dim;
  Tensor query, key;
  std::vector<Tensor> qkv;
  if (layer.qkv.size() == 1 && !layer.q_norm) {
    Tensor whole;
    qkv = product(layer.qkv[0], hidden, m, &whole);
    int64_t heads = qkv[0].size(-1) / dim, kv_heads = qkv[1].size(-1) / dim;
    Tensor both = rotary(whole.slice(-1, 0, (heads + kv_heads) * dim).view({batch, width, -1, dim}).transpose(1, 2),
                         c, s);
    query = both.slice(1, 0, heads);
    key = both.slice(1, heads);
  } else {
    qkv = products(layer.qkv, hidden, m);
    query = qkv[0].view({batch, width, -1, dim});
    key = qkv[1].view({batch, width, -1, dim});
    if (layer.q_norm) {
      query = rms_norm(query, *layer.q_norm);
      key = rms_norm(key, *layer.k_norm);
    }
    query = rotary(query.transpose(1, 2), c, s);
    key = rotary(key.transpose(1, 2), c, s);
  }
  Tensor value = qkv[2].view({batch, width, -1, dim}).transpose(1, 2);
  int64_t end = start + width;
  keys.slice(2, start, end).copy_(key);
  values.slice(2, start, end).copy_(value);
  Tensor out = layer.attention == kExact
                   ? exact_attention(query, keys.slice(2, 0, end), values.slice(2, 0, end), mask, layer.scaling)
                   : sdpa_attention(query, keys.slice(2, 0, end), values.slice(2, 0, end), mask, layer.scaling,
                                    layer.kv_groups);
  return product(layer.o, out.reshape({batch, width, -1}).contiguous(), m)[0];
}

// CompactForward._mlp
Tensor mlp(const Layer& layer, const Tensor& hidden, const MaskRows& m) {
  std::vector<Tensor> gate_up = products(layer.gate_up, hidden, m);
  return product(layer.down, at::silu(gate_up[0]) * gate_up[1], m)[0];
}

// A tensor the layers read, as a module holds it: (the module's parameter or buffer dict, name, tensor).
struct Source {
  py::dict tensors;
  py::str name;
  py::object tensor;
  Tensor value;
  std::pair<int64_t, int64_t> key;  // row_exact.weight_key when the stack was built
};

// A model's decoder layers with the tensors they read (native.NativeLayers).
class Stack {
 public:
  Stack(std::vector<Layer> layers, const std::vector<py::tuple>& sources, const std::vector<py::tuple>& kinds)
      : layers_(std::move(layers)) {
    for (const py::tuple& k : kinds) kinds_.emplace_back(k[0], k[1]);
    for (const py::tuple& s : sources) {
      Tensor value = s[2].cast<Tensor>();
      sources_.push_back(Source{s[0].cast<py::dict>(), s[1].cast<py::str>(), s[2], value, key_of(value)});
    }
  }

  // whether every source is still the tensor its module holds, unwritten and in place, and every linear layer
  // still of the type it had, since the stack was built
  bool fresh() const {
    for (const Source& s : sources_) {
      PyObject* held = PyDict_GetItem(s.tensors.ptr(), s.name.ptr());  // borrowed
      if (held != s.tensor.ptr() || key_of(s.value) != s.key) return false;
    }
    for (const auto& [layer, type] : kinds_) {
      if (reinterpret_cast<PyObject*>(Py_TYPE(layer.ptr())) != type.ptr()) return false;
    }
    return true;
  }

  // CompactForward.__call__'s layer loop: hidden [B, T, hidden] in, hidden out; masks: one per layer (or None);
  // keys, values: each layer's cache storage, the forward's entries written at columns [start, start + T)
  Tensor forward(Tensor hidden, const Tensor& cos, const Tensor& sin, const std::vector<c10::optional<Tensor>>& masks,
                 std::vector<Tensor> keys, std::vector<Tensor> values, int64_t start, bool mask_active,
                 bool mask_gated, c10::optional<Tensor> mask_dense, c10::optional<Tensor> mask_rows) const {
    TORCH_CHECK(masks.size() == layers_.size() && keys.size() == layers_.size() && values.size() == layers_.size(),
                "one mask, key and value storage per layer");
    MaskRows m{mask_active, mask_gated, mask_dense, mask_rows};
    Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      Tensor residual = hidden;
      hidden = residual + attention(layer, rms_norm(hidden, layer.input), c, s, masks[i], keys[i], values[i],
                                    start, m);
      residual = hidden;
      hidden = residual + mlp(layer, rms_norm(hidden, layer.post), m);
    }
    return hidden;
  }

 private:
  static std::pair<int64_t, int64_t> key_of(const Tensor& t) {
    return {reinterpret_cast<int64_t>(t.const_data_ptr()),
            t.is_inference() ? -1 : static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version())};
  }

  std::vector<Layer> layers_;
  std::vector<std::pair<py::object, py::object>> kinds_;  // (linear layer, its type)
  std::vector<Source> sources_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Update>(m, "Update").def(py::init<int64_t, Tensor, Tensor>());
  py::class_<Product>(m, "Product")
      .def(py::init<int64_t, Tensor, Tensor, c10::optional<Tensor>, int64_t, int64_t, std::vector<int64_t>,
                    std::vector<Update>>());
  py::class_<Norm>(m, "Norm").def(py::init<Tensor, double>());
  py::class_<Layer>(m, "Layer")
      .def(py::init<Norm, Norm, c10::optional<Norm>, c10::optional<Norm>, std::vector<Product>, Product,
                    std::vector<Product>, Product, int64_t, double, int64_t, int64_t>());
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<Layer>, const std::vector<py::tuple>&, const std::vector<py::tuple>&>())
      .def("fresh", &Stack::fresh)
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>());  // other threads run meanwhile
}
