"""Weights as shipped: linear layers that multiply by a GGUF file's 4-bit blocks (the linear kernel "int4").

A GGUF model such as the embedded base (SmolLM2-135M-Instruct, Q4_1) ships each weight matrix as blocks of 32
four-bit integers with a scale and an offset per block. The plain loader dequantizes them to bf16, so every
decoding forward streams 2 bytes per weight from memory; a one-token forward on the CPU is bound by that stream.
torch's weight-only int4 CPU kernel (`torch._weight_int4pack_mm_for_cpu`, groups of 32, bf16 activations)
multiplies by the 4-bit values themselves: a quarter of the bytes. On a 2-core AMX Xeon a whole one-token
forward of the embedded model takes 23 ms against 39 ms with packed bf16 weights; the kernel computes each row on
its own, so its cost grows with the rows (a 16-token forward: 46 against 43 ms; docs/BENCHMARKS.md, Current
results: *Cost-aware drafts*, the forward costs timed at load) and every row is bit for bit what it would be
alone (`int4_rows_match` checks this once), so the exact mode stays exact.

The kernel computes w = (q - 8) * scale + zero per block with scale and zero in bf16. A Q4_1 block is
w = d * q + m (d, m fp16), a Q4_0 block w = d * (q - 8): scale = d and zero = m + 8d (0 for Q4_0), rounded to
bf16. The result is the GGUF's own 4-bit grid with its scales rounded to bf16, where the plain load rounds every
dequantized weight to bf16 instead: two approximations of the same file, so greedy answers can differ between
the two kernels (docs/DECODING.md, "Weights as shipped"). That is why "int4" is chosen by the user
(`refusion.load(linear="int4")`, `--linear int4`), never by "auto".

Layers whose weights are not 4-bit in the file (the Q8_0 embedding that doubles as the LM head, adapter matrices)
keep the kernel "auto" gives them. Before switching a layer, the blocks are checked against the loaded weight, so
a layer whose weight no longer is the file's (a merged adapter) is refused with a one-line error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from refusion.model.kernels.row_exact import weight_key

GROUP = 32
"""Weights per block: GGUF's Q4_0 / Q4_1 blocks and the group size the int4 kernel is called with."""
SHIPPED_TYPES = ("Q4_0", "Q4_1")
"""GGUF tensor types whose blocks the int4 kernel multiplies by directly."""
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
    """One weight matrix as 4-bit blocks: w[n, k] = (q[n, k] - 8) * scale[n, k // GROUP] + zero[n, k // GROUP]."""

    q: torch.Tensor
    """[N, K] int32 in 0..15."""
    scale: torch.Tensor
    """[N, K / GROUP] float32."""
    zero: torch.Tensor
    """[N, K / GROUP] float32."""

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32 weight the blocks describe (scales and zeros in full precision)."""
        scale = self.scale.repeat_interleave(GROUP, 1)
        zero = self.zero.repeat_interleave(GROUP, 1)
        return (self.q - 8).float() * scale + zero


class Int4Linear(nn.Linear):
    """nn.Linear whose bf16 CPU inference forward multiplies by 4-bit blocks (`use_int4_linears`). Training and
    the state dict see the plain weight; writing it after the switch makes the forward refuse (the blocks would
    no longer describe it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.is_grad_enabled() or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features).contiguous()  # the kernel reads rows in place
        out = torch._weight_int4pack_mm_for_cpu(flat, *self.blocks())
        bias = self._parameters["bias"]
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


def int4_available() -> bool:
    """Whether this torch build has the CPU int4 weight-only kernel."""
    return all(hasattr(torch, name) for name in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"))


def can_switch(layer: nn.Linear) -> bool:
    """Whether a layer's shape and placement allow the int4 kernel (bf16 weights on the CPU, K a multiple of
    GROUP, N of PACK_MULTIPLE)."""
    return (layer.weight.device.type == "cpu" and layer.weight.dtype == torch.bfloat16
            and layer.in_features % GROUP == 0 and layer.out_features % PACK_MULTIPLE == 0)


def check_blocks(layer: nn.Linear, blocks: Int4Blocks) -> None:
    """Raise a one-line ValueError unless `blocks` describe the layer's weight (see MAX_WEIGHT_ERROR)."""
    weight = layer.weight.detach().float()
    if tuple(blocks.q.shape) != tuple(weight.shape):
        raise ValueError(f"4-bit blocks of shape {tuple(blocks.q.shape)} for a weight of shape {tuple(weight.shape)}")
    error = (blocks.dequantize() - weight).abs().amax(1)
    if bool((error > MAX_WEIGHT_ERROR * weight.abs().amax(1).clamp_min(1e-30)).any()):
        raise ValueError("the loaded weights are not the file's 4-bit blocks (an adapter merged into them?): "
                         "linear='int4' needs the weights as the file ships them")


def pack(blocks: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed 4-bit weight [N, K/2] uint8, scales and zeros [K/GROUP, N, 2] bf16): what the kernel takes."""
    packed = torch._convert_weight_to_int4pack_for_cpu(blocks.q.contiguous(), 1)
    scales = torch.stack([blocks.scale.t(), blocks.zero.t()], -1).to(torch.bfloat16).contiguous()
    return packed, scales


def switch_to_int4(layer: nn.Linear, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Make `layer` an Int4Linear multiplying by `packed` with `scales` (`pack`)."""
    layer.__class__ = Int4Linear
    layer.register_buffer("int4_weight", packed, persistent=False)
    layer.register_buffer("int4_scales", scales, persistent=False)
    layer.int4_key = weight_key(layer.weight)


def file_layer_name(module_name: str) -> str:
    """The name a linear layer has in the model the file loads as (a mask-gated adapter wraps it as `base_layer`)."""
    return module_name.removesuffix(".base_layer")


def use_int4_linears(model: nn.Module, packed: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Switch the linear layers named in `packed` ({file layer name: `pack` output}) to Int4Linear; returns how
    many."""
    switched = 0
    for name, layer in list(model.named_modules()):
        weights = packed.get(file_layer_name(name))
        if type(layer) is nn.Linear and weights is not None and can_switch(layer):
            switch_to_int4(layer, *weights)
            switched += 1
    return switched


def shipped_int4(path: str | Path, model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The packed 4-bit layers of a GGUF file for `model` (loaded from it), {file layer name: `pack` output}: read,
    checked against the model's weights and packed once, then kept in the model cache (`build_cache`) beside the
    dequantized model, so later loads read them back."""
    from refusion.model import build_cache

    path = Path(path)

    def build():
        modules = {file_layer_name(name): m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        packed = {}
        for name, blocks in read_gguf_blocks(path, model).items():
            layer = modules.get(name)
            if layer is not None and can_switch(layer):
                check_blocks(layer, blocks)
                packed[name] = pack(blocks)
        return (packed,)

    inputs = {"gguf": str(path.resolve()), "kernel": "int4", "layers": sorted(_file_layer_shapes(model))}
    key = {"versions": build_cache.versions("refusion", "torch", "gguf", "safetensors"),
           "base_files": [build_cache.file_identity(path)]}
    (packed,) = build_cache.cached_build(f"{path.stem}-int4", inputs, key, build, save=_save_packed,
                                         load=_load_packed)
    return packed


def _file_layer_shapes(model: nn.Module) -> set[str]:
    return {f"{file_layer_name(name)}:{m.out_features}x{m.in_features}" for name, m in model.named_modules()
            if isinstance(m, nn.Linear)}


PACKED_FILE = "int4.safetensors"


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
def read_gguf_blocks(path: str | Path, model: nn.Module) -> dict[str, Int4Blocks]:
    """The 4-bit blocks of a GGUF file's Q4_0 / Q4_1 tensors, keyed by the layer names of `model` (loaded from that
    file by transformers: the same name map and row order transformers used; `file_layer_name`)."""
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
    blocks = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SHIPPED_TYPES or not tensor.name.endswith(".weight"):
            continue
        module_name = names.get(tensor.name)
        if module_name is None:
            continue
        q, d, m = _unpack_blocks(np.asarray(tensor.data), tensor.tensor_type.name)  # rows as the file orders them
        q, d, m = (processor.process(weights=a, name=tensor.name).weights for a in (q, d, m))
        scale = torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32))
        zero = torch.from_numpy(np.ascontiguousarray(m, dtype=np.float32)) + 8 * scale if m is not None \
            else torch.zeros_like(scale)
        blocks[module_name] = Int4Blocks(torch.from_numpy(np.ascontiguousarray(q)), scale, zero)
    return blocks


def _gguf_architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _unpack_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw GGUF rows [N, blocks * bytes per block] uint8 -> q [N, K] int32, d [N, K/32] and m [N, K/32] float32
    (m None for Q4_0). ggml's layout: fp16 d (and fp16 m), then 16 bytes whose low nibbles are weights 0-15 of
    the block and whose high nibbles are weights 16-31."""
    header = 4 if kind == "Q4_1" else 2
    rows = data.shape[0]
    raw = data.reshape(rows, -1, header + GROUP // 2)  # [N, blocks, bytes]
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    packed = raw[..., header:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int32)  # [N, blocks, 32]
    return q.reshape(rows, -1), d, m


@functools.cache
def int4_rows_match(rows: int = 32) -> bool:
    """Whether the int4 kernel computes each row of a product of up to `rows` rows bit for bit as alone (a fact of
    the machine and torch build, probed once on random blocks)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 4 * GROUP), generator=generator, dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = torch.rand(4, 64, 2, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 4 * GROUP, generator=generator).to(torch.bfloat16)
    alone = torch.cat([torch._weight_int4pack_mm_for_cpu(x[i:i + 1], packed, GROUP, scales) for i in range(rows)])
    return all(torch.equal(torch._weight_int4pack_mm_for_cpu(x[:r], packed, GROUP, scales), alone[:r])
               for r in range(2, rows + 1))
