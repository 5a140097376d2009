"""`model.kernels.registry`: the one map from a layer's class to its kernel, agreeing with the C++ layers and with
what `prepare` reports."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from torch import nn

from refusion.model.kernels import registry
from refusion.model.kernels.extension import SOURCES
from refusion.model.kernels.narrow import NarrowLinear, use_narrow_linears
from refusion.model.setup import plain_setup
from refusion.model.tiny import tiny_model


def test_every_kernel_has_a_name_a_class_and_a_code_the_cpp_layers_know():
    names = [k.name for k in registry.LINEAR_KERNELS]
    assert len(set(names)) == len(names) and ("auto", *names) == registry.LINEAR_CHOICES
    constants = {name.lower().replace("q8", "-q8"): int(value) for name, value in
                 re.findall(r"constexpr int64_t k(Plain|Packed|Int4Q8|Int4|Sgemm|Narrow) = (\d+);",
                            SOURCES[0].read_text())}
    assert constants == {k.name: k.native_code for k in registry.LINEAR_KERNELS}
    for kernel in registry.LINEAR_KERNELS:
        assert issubclass(kernel.layer_class, nn.Linear) and registry.kernel(kernel.name) is kernel
        assert kernel.devices and kernel.dtypes and kernel.summary
        assert isinstance(kernel.is_available(), bool)
    assert registry.kernel("packed").row_exact and not registry.kernel("plain").row_exact
    assert registry.kernel("int4").auto  # fp32 GGUF models only (`choice.fp32_blocks`; tests/model/test_int4.py)
    assert not registry.kernel("int4-q8").auto  # it rounds the rows: other numbers than the base model's
    with pytest.raises(KeyError, match="no linear kernel 'fast'"):
        registry.kernel("fast")
    with pytest.raises(ValueError, match="linear='fast' is invalid: must be one of auto, plain"):
        registry.check_linear("fast")


def test_a_model_reports_the_kernel_its_layers_run():
    model = tiny_model("llama")
    assert registry.linear_kernel_of(model) == "plain" and plain_setup(model).kernels.linear == "plain"
    use_narrow_linears(model, force=True)
    assert all(registry.kernel_of_layer(m) is registry.kernel("narrow") for m in model.modules()
               if isinstance(m, NarrowLinear))
    assert registry.linear_kernel_of(model) == "narrow" and plain_setup(model).kernels.linear == "narrow"
    assert registry.kernel_of_layer(nn.ReLU()) is None


def test_the_registry_loads_without_torch():
    code = ("import sys; from refusion.model.kernels.registry import LINEAR_CHOICES; "
            "print('torch' in sys.modules, len(LINEAR_CHOICES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", str(len(registry.LINEAR_CHOICES))]
