"""The C structs the row-exact kernels take (rowexact.c, formats.h), mirrored for ctypes: a linear
weight's descriptor, one decoder layer's tensors, a sequence's share of a fused forward and the
forward's arguments. Layouts only; `d3d.kernels.binding` fills and passes them."""

from __future__ import annotations

import ctypes

from d3d.kernels.packing import MAX_PARTS, WEIGHT_FORMATS, WeightStream

c_i64, c_ptr = ctypes.c_int64, ctypes.c_void_p


class Part(ctypes.Structure):
    """d3d_part: a run of a linear weight's rows, its bytes and their format (formats.h)."""

    _fields_ = [("data", c_ptr), ("format", c_i64), ("rows", c_i64)]


class Weight(ctypes.Structure):
    """d3d_weight: a linear weight as its runs of rows."""

    _fields_ = [("parts", Part * MAX_PARTS), ("dense", Part), ("grouped", Part)]

    @classmethod
    def of(cls, stream: WeightStream, dense: WeightStream | None = None,
           grouped: WeightStream | None = None) -> "Weight":
        """The descriptor of `stream`, with `dense` (the same weight as bf16 values, one part) for
        calls of several rows and `grouped` (its blocks 16 rows at a time) for calls of a few, when
        the stream is quantized."""
        weight = cls()
        filled = [*zip(weight.parts, stream.parts)]
        filled += [(slot, extra.parts[0]) for slot, extra in ((weight.dense, dense), (weight.grouped, grouped))
                   if extra is not None]
        for slot, part in filled:
            slot.data, slot.format, slot.rows = part.data.data_ptr(), WEIGHT_FORMATS[part.format], part.rows
        return weight


class Layer(ctypes.Structure):
    """d3d_layer: one decoder layer's tensors, by name (NULL where the architecture has none)."""

    _fields_ = [("input_norm", c_ptr), ("qkv", Weight), ("qkv_bias", c_ptr), ("q_norm", c_ptr), ("k_norm", c_ptr),
                ("o", Weight), ("o_bias", c_ptr), ("post_norm", c_ptr), ("gate_up", Weight),
                ("gate_up_bias", c_ptr), ("down", Weight), ("down_bias", c_ptr)]


class SegmentArgs(ctypes.Structure):
    """d3d_segment: one sequence's rows of a fused forward and its own KV cache."""

    _fields_ = [("rows", c_i64), ("start", c_i64), ("k_cache", c_ptr), ("v_cache", c_ptr), ("kv_layer", c_i64),
                ("kv_head", c_i64), ("v_row", c_i64), ("v_part", c_i64), ("k_tiled", c_i64), ("mask", c_ptr)]


class ForwardArgs(ctypes.Structure):
    """d3d_forward_args: everything one fused forward reads and writes."""

    _fields_ = [("layers", ctypes.POINTER(Layer)), ("num_layers", c_i64), ("hidden", c_i64), ("heads", c_i64),
                ("kv_heads", c_i64), ("head_dim", c_i64), ("intermediate", c_i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("x", c_ptr), ("rope", c_ptr), ("positions", c_ptr),
                ("rope_positions", c_i64), ("segments", ctypes.POINTER(SegmentArgs)), ("num_segments", c_i64),
                ("rows", c_i64), ("final_norm", c_ptr), ("out", c_ptr), ("work", c_ptr), ("scores", c_ptr),
                ("linear_scratch", c_ptr), ("threads", c_i64), ("keep_rows", c_i64)]


LAYER_SLOTS = tuple(name for name, _ in Layer._fields_)  # a layer's tensors, in the C struct's order
LINEAR_SLOTS = frozenset(name for name, kind in Layer._fields_ if kind is Weight)
