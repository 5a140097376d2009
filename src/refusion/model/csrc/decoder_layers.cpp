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

struct Layer {
  Norm input, post;
  c10::optional<Norm> q_norm, k_norm;  // Qwen3
  std::vector<Product> qkv;            // one fused product, or q, k, v
  Product o;
  std::vector<Product> gate_up;        // one fused product, or gate, up
  Product down;
  int64_t head_dim;
  double scaling;
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
// MaskGatedLoRA updates of the members: the members' outputs in order
std::vector<Tensor> product(const Product& p, const Tensor& x, const MaskRows& m) {
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

// CompactForward._attention with apply_rotary_pos_emb and SlotCache.write (native.py: `SlotCache.native_storage`)
Tensor attention(const Layer& layer, const Tensor& hidden, const Tensor& cos, const Tensor& sin,
                 const c10::optional<Tensor>& mask, Tensor& keys, Tensor& values, int64_t start, const MaskRows& m) {
  int64_t batch = hidden.size(0), width = hidden.size(1);
  std::vector<Tensor> qkv = products(layer.qkv, hidden, m);
  Tensor query = qkv[0].view({batch, width, -1, layer.head_dim});
  Tensor key = qkv[1].view({batch, width, -1, layer.head_dim});
  if (layer.q_norm) {
    query = rms_norm(query, *layer.q_norm);
    key = rms_norm(key, *layer.k_norm);
  }
  query = query.transpose(1, 2);
  key = key.transpose(1, 2);
  Tensor value = qkv[2].view({batch, width, -1, layer.head_dim}).transpose(1, 2);
  Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  query = (query * c) + (rotate_half(query) * s);
  key = (key * c) + (rotate_half(key) * s);
  int64_t end = start + width;
  keys.slice(2, start, end).copy_(key);
  values.slice(2, start, end).copy_(value);
  Tensor out = exact_attention(query, keys.slice(2, 0, end), values.slice(2, 0, end), mask, layer.scaling);
  return product(layer.o, out.reshape({batch, width, -1}).contiguous(), m)[0];
}

// CompactForward._mlp
Tensor mlp(const Layer& layer, const Tensor& hidden, const MaskRows& m) {
  std::vector<Tensor> gate_up = products(layer.gate_up, hidden, m);
  return product(layer.down, at::silu(gate_up[0]) * gate_up[1], m)[0];
}

// A model's decoder layers with the tensors they read (native.NativeLayers).
class Stack {
 public:
  Stack(std::vector<Layer> layers, std::vector<Tensor> watched) : layers_(std::move(layers)), watched_(std::move(watched)) {
    for (const Tensor& t : watched_) keys_.push_back(key_of(t));
  }

  // whether no watched tensor was written or moved since the stack was built (row_exact.weight_key)
  bool fresh() const {
    for (size_t i = 0; i < watched_.size(); ++i) {
      if (key_of(watched_[i]) != keys_[i]) return false;
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
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      Tensor residual = hidden;
      hidden = residual + attention(layer, rms_norm(hidden, layer.input), cos, sin, masks[i], keys[i], values[i],
                                    start, m);
      residual = hidden;
      hidden = residual + mlp(layer, rms_norm(hidden, layer.post), m);
    }
    return hidden;
  }

 private:
  static std::pair<int64_t, int64_t> key_of(const Tensor& t) {
    return {reinterpret_cast<int64_t>(t.data_ptr()), t.is_inference() ? -1 : static_cast<int64_t>(t._version())};
  }

  std::vector<Layer> layers_;
  std::vector<Tensor> watched_;
  std::vector<std::pair<int64_t, int64_t>> keys_;
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
                    std::vector<Product>, Product, int64_t, double>());
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<Layer>, std::vector<Tensor>>())
      .def("fresh", &Stack::fresh)
      .def("forward", &Stack::forward);
}
