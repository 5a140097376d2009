"""Weights as shipped: linear layers that multiply by a GGUF file's blocks of 4-bit weights (the linear kernel "int4").

A GGUF model such as the embedded base (SmolLM2-135M-Instruct, Q4_1) ships each weight matrix as blocks of 32
four-bit integers with a scale and an offset per block. The plain loader dequantizes them to the model's dtype, so
every decoding forward streams 2 (bf16) or 4 (fp32) bytes per weight from memory; a one-token forward on the CPU is
bound by that stream. The "int4" kernel multiplies by the blocks themselves, a half byte per weight, in one of two
ways chosen by the model's dtype (never by timing):

- **bf16 models**: torch's weight-only int4 CPU kernel (`torch._weight_int4pack_mm_for_cpu`, groups of 32, bf16
  activations). It computes w = (q - 8) * scale + zero per block with scale and zero rounded to bf16: the GGUF's own
  4-bit grid with its scales rounded to bf16, where the plain load rounds every dequantized weight to bf16 instead:
  two approximations of the same file, so greedy answers can differ between the two kernels (docs/DECODING.md,
  "Weights as shipped"). On a 2-core AMX Xeon a one-token forward of the embedded model takes 23 ms against 39 ms
  with packed bf16 weights; each row is computed on its own (`int4_rows_match` checks it once), so its cost grows
  with the rows.
- **fp32 models**: refusion's own kernel (`csrc/block_products.cpp`, AVX2 and FMA where the CPU has them). A block
  is dequantized to fp32 exactly as gguf (and so the plain fp32 load) dequantizes it, so the weights are the plain
  model's bit for bit and only the order of summation differs from F.linear's; the LM head, which the file ships
  as 8-bit blocks (Q8_0, the embedding's), multiplies by its blocks too. A tile of outputs is dequantized once per
  call and every row multiplied by it, so a forward of several rows reads the weights once. Every output element
  is summed the same way whatever the rows and threads: each row comes out bit for bit as it would alone. Where the
  C++ extension cannot be built, the layers multiply by their fp32 weight with F.linear (the same weights).

Layers whose weights are not blocks in the file (adapter matrices; the Q8_0 head of a bf16 model) are packed in bf16
where the CPU allows it and stay plain in fp32. Either way "int4" changes how products round. In bf16 it is the user's
choice (`refusion.load(linear="int4")`, `--linear int4`), never "auto"'s; in fp32, whose weights are the plain
load's, "auto" takes it where the kernel runs vectorized (`choice.fp32_blocks`), as it takes the other fp32 kernels
that sum in their own order. Before switching a layer, the blocks are checked
against the loaded weight, so a layer whose weight no longer is the file's (a merged adapter) is refused with a
one-line error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from refusion.model.kernels.extension import native_available, native_extension
from refusion.model.kernels.row_exact import weight_key

GROUP = 32
"""Weights per block: GGUF's Q4_0 / Q4_1 / Q8_0 blocks and the group size the int4 kernels are called with."""
SHIPPED_TYPES = ("Q4_0", "Q4_1")
"""GGUF tensor types whose blocks the int4 kernel multiplies by directly (bf16 and fp32 models)."""
FP32_TYPES = (*SHIPPED_TYPES, "Q8_0")
"""GGUF tensor types whose blocks fp32 models multiply by (`csrc/block_products.cpp` takes 8-bit blocks too)."""
PACK_MULTIPLE = 16
"""The int4 packing needs the output features to be a multiple of this (other layers keep their kernel)."""
MAX_WEIGHT_ERROR = 2.0**-7
"""A layer's blocks match its loaded weight when they differ by at most this fraction of the largest magnitude
in the row (rounding the dequantized weight to bf16 moves each value by at most 2^-8 of it)."""


STALE_BLOCKS = ("a linear layer's weight changed after it was switched to 4-bit blocks (linear='int4'): load the "
                "model again to decode with the new weights")
"""The error of a product by blocks that no longer describe the layer's weight (`Int4Linear`, `model.kernels.fused`)."""


@dataclass(frozen=True)
class Int4Blocks:
    """One weight matrix as a GGUF file's blocks: w[n, k] = q[n, k] * scale[n, k // GROUP] + offset[n, k // GROUP],
    computed in fp32 as gguf dequantizes them (Q4_1: d q + m; Q4_0: d q - 8 d; Q8_0: d q)."""

    q: torch.Tensor
    """[N, K] int32: 0..15 (4-bit blocks) or -128..127 (8-bit)."""
    scale: torch.Tensor
    """[N, K / GROUP] float32 (the block's fp16 d)."""
    offset: torch.Tensor
    """[N, K / GROUP] float32 (Q4_1: the block's fp16 m; Q4_0: -8 d; Q8_0: 0)."""
    bits: int = 4
    """4 or 8."""

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 weight the blocks describe, bit for bit gguf's (q * d is exact in fp32; + m rounds)."""
        return self.q.float() * self.scale.repeat_interleave(GROUP, 1) + self.offset.repeat_interleave(GROUP, 1)


class Int4Linear(nn.Linear):
    """nn.Linear whose CPU inference forward multiplies by the file's blocks (`use_int4_linears`): bf16 rows by
    torch's int4 kernel, fp32 rows by refusion's (`block_product`). Training and the state dict see the plain
    weight; writing it after the switch makes the forward refuse (the blocks would no longer describe it)."""

    int8_rows: ClassVar[bool] = False
    """Whether fp32 rows are rounded to 8-bit blocks before they multiply the blocks (`Int4Q8Linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not takes_rows(x, self._buffers["int4_scales"]):
            return F.linear(x, self.weight, self.bias)
        weight, group, scales = self.blocks()
        bias = self._parameters["bias"]
        if x.dtype == torch.float32:
            return block_product(x, weight, scales, bias, self.tail(), self.int8_rows)
        flat = x.reshape(-1, self.in_features).contiguous()  # the kernel reads rows in place
        out = torch._weight_int4pack_mm_for_cpu(flat, weight, group, scales)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], self.out_features)

    def blocks(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        """(4-bit weight, GROUP, scales and zeros) as the kernel takes them; refused when the weight changed since."""
        # the module's dicts read directly: nn.Module's attribute lookup costs microseconds, 210 times a forward
        if weight_key(self._parameters["weight"]) != self.int4_key:
            raise RuntimeError(STALE_BLOCKS)
        buffers = self._buffers
        return buffers["int4_weight"], GROUP, buffers["int4_scales"]

    def tail(self) -> torch.Tensor | None:
        """fp32: the weight's rows after the blocks' (an LM head grown by added tokens), multiplied as they are."""
        blocked = self._buffers["int4_weight"].shape[0]
        return self._parameters["weight"].detach()[blocked:] if blocked < self.out_features else None


class Int4Q8Linear(Int4Linear):
    """Int4Linear (fp32 models) whose rows are rounded to blocks of 32 signed bytes (a scale each: the largest
    magnitude maps to 127) and multiplied by the file's blocks in integers, as llama.cpp multiplies them (the linear
    kernel "int4-q8", only ever pinned: its numbers are not the base model's). A one-row product does a fraction of
    the fp32 kernel's work and reads the same blocks; each row is still computed as it would be alone."""

    int8_rows: ClassVar[bool] = True


ROWS_OF_SCALES = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float32}
"""The rows' dtype each layout of scales multiplies: torch's (bf16 scales and zeros) bf16 rows, refusion's (the
file's fp16 scales and offsets) fp32 rows."""


def takes_rows(x: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether an inference product of `x` runs by the blocks whose scales are `scales` (bf16 rows with torch's
    layout, fp32 rows with refusion's where its extension runs); otherwise the plain weight multiplies."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.numel() == 0 or x.dtype != ROWS_OF_SCALES[scales.dtype]:
        return False
    return x.dtype == torch.bfloat16 or native_available()


def blocks_vectorized() -> bool:
    """Whether refusion's fp32 block kernel runs here, vectorized (its extension built, the CPU with AVX2, FMA and
    F16C): where "auto" multiplies an fp32 GGUF model by its blocks (`choice.fp32_blocks`)."""
    native = native_extension()
    return native is not None and bool(native.blocks_vectorized())


def block_product(x: torch.Tensor, q: torch.Tensor, dm: torch.Tensor, bias: torch.Tensor | None,
                  tail: torch.Tensor | None = None, int8_rows: bool = False) -> torch.Tensor:
    """x [..., K] fp32 times the weight whose blocks are (`q`, `dm`) (`pack_fp32`) followed by the fp32 rows `tail`,
    plus `bias`: each row as alone. `int8_rows`: x rounded to 8-bit blocks first and multiplied in integers, as
    llama.cpp multiplies (the kernel "int4-q8"; the tail rows still multiply x as it is)."""
    return native_extension().block_linear(x, q, dm, tail, bias, int8_rows)


def int4_available() -> bool:
    """Whether this torch build has the CPU int4 weight-only kernel (what bf16 models multiply by; fp32 models
    multiply by refusion's own, or by their plain weights)."""
    return all(hasattr(torch, name) for name in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"))


def can_switch(layer: nn.Linear, rows: int | None = None, bits: int = 4) -> bool:
    """Whether a layer's shape and placement allow the int4 kernel for `rows` rows of blocks (None: all of its
    outputs): bf16 weights, all in 4-bit blocks, or fp32 weights, whose rows after the blocks' multiply as they
    are; on the CPU; K a multiple of GROUP, the blocks' rows of PACK_MULTIPLE."""
    rows = layer.out_features if rows is None else rows
    fp32 = layer.weight.dtype == torch.float32
    if not fp32 and (layer.weight.dtype != torch.bfloat16 or bits != 4 or rows != layer.out_features):
        return False
    return (layer.weight.device.type == "cpu" and layer.in_features % GROUP == 0 and rows % PACK_MULTIPLE == 0
            and 0 < rows <= layer.out_features)


def check_blocks(layer: nn.Linear, blocks: Int4Blocks) -> None:
    """Raise a one-line ValueError unless `blocks` describe the layer's weight (see MAX_WEIGHT_ERROR)."""
    weight = layer.weight.detach().float()[:blocks.q.shape[0]]  # fp32: rows after the blocks' multiply as they are
    if tuple(blocks.q.shape) != tuple(weight.shape):
        raise ValueError(f"blocks of shape {tuple(blocks.q.shape)} for a weight of shape {tuple(layer.weight.shape)}")
    error = (blocks.dequantize() - weight).abs().amax(1)
    if bool((error > MAX_WEIGHT_ERROR * weight.abs().amax(1).clamp_min(1e-30)).any()):
        raise ValueError("the loaded weights are not the file's 4-bit blocks (an adapter merged into them?): "
                         "linear='int4' needs the weights as the file ships them")


def pack(blocks: Int4Blocks, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks as the `dtype` model's kernel takes them: bf16, torch's (packed 4-bit weight [N, K/2] uint8,
    scales and zeros [K/GROUP, N, 2] bf16, zero = offset + 8 scale); fp32, `pack_fp32`'s."""
    if dtype == torch.float32:
        return pack_fp32(blocks)
    packed = torch._convert_weight_to_int4pack_for_cpu(blocks.q.contiguous(), 1)
    zero = blocks.offset + 8 * blocks.scale
    scales = torch.stack([blocks.scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
    return packed, scales


def pack_fp32(blocks: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, dm) as `csrc/block_products.cpp` takes them: q [N, K/2] uint8 in ggml's order (a block's weights 0-15 in
    the low nibbles of its 16 bytes, 16-31 in the high ones) or [N, K] int8 (8-bit blocks); dm [N, K/GROUP, 2]
    fp16, each block's (scale, offset): the file's own fp16 numbers (Q4_0's offset -8 d is exact in fp16 too)."""
    rows, features = blocks.q.shape
    if blocks.bits == 8:
        q = blocks.q.to(torch.int8).contiguous()
    else:
        halves = blocks.q.reshape(rows, features // GROUP, 2, GROUP // 2)
        q = (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).reshape(rows, features // 2).contiguous()
    dm = torch.stack([blocks.scale, blocks.offset], -1)
    half = dm.to(torch.float16)
    if not torch.equal(half.float(), dm):
        raise ValueError("block scales or offsets that fp16 does not hold exactly: not a GGUF file's blocks")
    return q, half.contiguous()


def packed_shape(packed: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    """(rows, bits) of a `pack` output: bf16's packed weight or fp32's uint8 nibbles (4 bits) or int8 bytes (8)."""
    return packed[0].shape[0], 8 if packed[0].dtype == torch.int8 else 4


def switch_to_int4(layer: nn.Linear, packed: torch.Tensor, scales: torch.Tensor,
                   layer_class: type[Int4Linear] = Int4Linear) -> None:
    """Make `layer` an Int4Linear (or `layer_class`, Int4Q8Linear) multiplying by `packed` with `scales` (`pack`)."""
    layer.__class__ = layer_class
    layer.register_buffer("int4_weight", packed, persistent=False)
    layer.register_buffer("int4_scales", scales, persistent=False)
    layer.int4_key = weight_key(layer.weight)


def file_layer_name(module_name: str) -> str:
    """The name a linear layer has in the model the file loads as (a mask-gated adapter wraps it as `base_layer`)."""
    return module_name.removesuffix(".base_layer")


def use_int4_linears(model: nn.Module, packed: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     layer_class: type[Int4Linear] = Int4Linear) -> int:
    """Switch the linear layers named in `packed` ({file layer name: `pack` output}) to `layer_class`; returns how
    many."""
    switched = 0
    for name, layer in list(model.named_modules()):
        weights = packed.get(file_layer_name(name))
        if type(layer) is nn.Linear and weights is not None and can_switch(layer, *packed_shape(weights)):
            switch_to_int4(layer, *weights, layer_class)
            switched += 1
    return switched


def shipped_int4(path: str | Path, model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The packed block layers of a GGUF file for `model` (loaded from it), {file layer name: `pack` output}: read,
    checked against the model's weights and packed once for its dtype (bf16: the 4-bit layers; fp32: the 8-bit
    head too), then kept in the model cache (`build_cache`) beside the dequantized model, so later loads read them
    back."""
    from refusion.model import build_cache

    path = Path(path)
    dtype = next(model.parameters()).dtype
    types = FP32_TYPES if dtype == torch.float32 else SHIPPED_TYPES

    def build():
        modules = {file_layer_name(name): m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        packed = {}
        for name, blocks in read_gguf_blocks(path, model, types).items():
            layer = modules.get(name)
            if layer is not None and can_switch(layer, blocks.q.shape[0], blocks.bits):
                check_blocks(layer, blocks)
                packed[name] = pack(blocks, dtype)
        return (packed,)

    inputs = {"gguf": str(path.resolve()), "kernel": "int4", "dtype": str(dtype), "layout": PACK_LAYOUT,
              "layers": sorted(_file_layer_shapes(model))}
    key = {"versions": build_cache.versions("refusion", "torch", "gguf", "safetensors"),
           "base_files": [build_cache.file_identity(path)]}
    (packed,) = build_cache.cached_build(f"{path.stem}-int4-{str(dtype).removeprefix('torch.')}", inputs, key, build,
                                         save=_save_packed, load=_load_packed)
    return packed


def _file_layer_shapes(model: nn.Module) -> set[str]:
    return {f"{file_layer_name(name)}:{m.out_features}x{m.in_features}" for name, m in model.named_modules()
            if isinstance(m, nn.Linear)}


PACKED_FILE = "int4.safetensors"
PACK_LAYOUT = 2
"""Part of the cached blocks' inputs: bump when `pack` changes what it returns (2: fp32 models' scales in fp16)."""


def _save_packed(built: tuple, directory: Path) -> None:
    from safetensors.torch import save_file

    (packed,) = built
    tensors = {f"{name}.{part}": tensor for name, pair in packed.items() for part, tensor in zip(("q", "scales"), pair)}
    save_file(tensors, directory / PACKED_FILE)


def _load_packed(directory: Path) -> tuple:
    from safetensors.torch import load_file

    tensors = load_file(directory / PACKED_FILE)
    names = {key.rsplit(".", 1)[0] for key in tensors}
    return ({name: (tensors[f"{name}.q"], tensors[f"{name}.scales"]) for name in names},)


# ------------------------------------------------------------------------------------------------ GGUF files
def read_gguf_blocks(path: str | Path, model: nn.Module, types: tuple[str, ...] = SHIPPED_TYPES) -> dict[str, Int4Blocks]:
    """The blocks of a GGUF file's tensors of `types` (SHIPPED_TYPES, FP32_TYPES), keyed by the layer names of
    `model` (loaded from that file by transformers: the same name map and row order transformers used;
    `file_layer_name`). A file without an output tensor whose model ties its LM head to the embedding gives the
    embedding's blocks to the head."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(path))
    architecture = _gguf_architecture(reader)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        return {}
    name_map = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    names = {}  # {gguf tensor name: module name}, as transformers maps them when it loads the file
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hf_name = file_layer_name(module_name)
            gguf_name = name_map.get_name(processor.preprocess_name(hf_name + ".weight").removesuffix(".weight"))
            if gguf_name is not None:
                names[gguf_name + ".weight"] = hf_name
    in_file = {tensor.name for tensor in reader.tensors}
    head = next((name for name, module in names.items() if module == "lm_head"), None)
    if head is not None and head not in in_file and _ties_head(model):
        names[name_map.get_name("model.embed_tokens") + ".weight"] = "lm_head"
    blocks = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in types or not tensor.name.endswith(".weight"):
            continue
        module_name = names.get(tensor.name)
        if module_name is None:
            continue
        q, d, m = _unpack_blocks(np.asarray(tensor.data), kind)  # rows as the file orders them
        q, d, m = (processor.process(weights=a, name=tensor.name).weights for a in (q, d, m))
        scale = torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32))
        offset = torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32))
        blocks[module_name] = Int4Blocks(torch.from_numpy(np.ascontiguousarray(q)), scale, offset,
                                         8 if kind == "Q8_0" else 4)
    return blocks


def _ties_head(model: nn.Module) -> bool:
    """Whether the model's LM head multiplies by its input embedding's weight."""
    head, embeddings = getattr(model, "lm_head", None), model.get_input_embeddings()
    return head is not None and embeddings is not None and head.weight is embeddings.weight


def _gguf_architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _unpack_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw GGUF rows [N, blocks * bytes per block] uint8 -> q [N, K] int32, d and m [N, K/32] float32 with
    w = q d + m. ggml's layouts: Q4_1, fp16 d and fp16 m, then 16 bytes whose low nibbles are weights 0-15 of the
    block and whose high nibbles are weights 16-31; Q4_0, fp16 d and the nibbles, w = (q - 8) d (m = -8 d, exact);
    Q8_0, fp16 d and 32 signed bytes (m = 0)."""
    header = 4 if kind == "Q4_1" else 2
    rows = data.shape[0]
    payload = GROUP if kind == "Q8_0" else GROUP // 2
    raw = data.reshape(rows, -1, header + payload)  # [N, blocks, bytes]
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = raw[..., header:].copy().view(np.int8).astype(np.int32)
        return q.reshape(rows, -1), d, np.zeros_like(d)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8 * d
    packed = raw[..., header:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int32)  # [N, blocks, 32]
    return q.reshape(rows, -1), d, m


def _rows_as_alone(product, x: torch.Tensor) -> bool:
    """Whether `product` computes every prefix of the rows of `x` bit for bit as it computes each row alone."""
    alone = torch.cat([product(x[i:i + 1]) for i in range(x.shape[0])])
    return all(torch.equal(product(x[:r]), alone[:r]) for r in range(2, x.shape[0] + 1))


@functools.cache
def int8_rows_match(rows: int = 32) -> bool:
    """Whether the kernel "int4-q8" computes each row of a product of up to `rows` rows bit for bit as alone, on
    4-bit and 8-bit blocks (a fact of the machine, probed once on random blocks: its few-row and many-row products
    are different loops that must sum alike)."""
    if not native_available():
        return False
    generator = torch.Generator().manual_seed(0)
    four = Int4Blocks(torch.randint(0, 16, (64, 4 * GROUP), generator=generator, dtype=torch.int32),
                      *torch.rand(2, 64, 4, generator=generator).half().float())
    scale = torch.rand(64, 4, generator=generator).half().float()
    eight = Int4Blocks(torch.randint(-128, 128, (64, 4 * GROUP), generator=generator, dtype=torch.int32), scale,
                       torch.zeros_like(scale), 8)
    x = torch.randn(rows, 4 * GROUP, generator=generator)
    packed = [pack_fp32(blocks) for blocks in (four, eight)]
    return all(_rows_as_alone(lambda rows_, q=q, dm=dm: block_product(rows_, q, dm, None, int8_rows=True), x)
               for q, dm in packed)


@functools.cache
def int4_rows_match(rows: int = 32) -> bool:
    """Whether the int4 kernels compute each row of a product of up to `rows` rows bit for bit as alone (a fact of
    the machine and torch build, probed once on random blocks): torch's (bf16 models) where this build has it, and
    refusion's (fp32 models), which needs its C++ extension (without it, fp32 layers multiply by F.linear)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 4 * GROUP), generator=generator, dtype=torch.int32)
    scale, offset = torch.rand(2, 64, 4, generator=generator).half().float()  # fp16, as a file holds
    blocks = Int4Blocks(q, scale, offset)
    x = torch.randn(rows, 4 * GROUP, generator=generator)
    if not native_available() or not _rows_as_alone(lambda rows_: block_product(rows_, *pack_fp32(blocks), None), x):
        return False
    if not int4_available():
        return True
    packed, scales = pack(blocks)
    return _rows_as_alone(lambda rows_: torch._weight_int4pack_mm_for_cpu(rows_.to(torch.bfloat16), packed, GROUP,
                                                                         scales), x)
