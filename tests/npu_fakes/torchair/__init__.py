"""Stand-in for Ascend's ``torchair`` (graph mode for torch.compile on NPU).

``register_fx_node_ge_converter(op)`` registers how an op is lowered to Ascend's graph engine:
the converter only runs when a graph is compiled for an NPU, so here the decorator registers
nothing and returns the function unchanged. Every other name imports (``from torchair import
ge``) and calling it raises ``NotImplementedError`` naming it."""

from _npu_fake_common import install_finder, module_getattr


def register_fx_node_ge_converter(_op):
    def register(fn):
        return fn
    return register


__getattr__ = module_getattr("torchair")
install_finder()
