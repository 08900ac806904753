"""Decoding encoded values: the decoders bound to a validated model, and the encoded-versus-
decoded conversions.

This package sits above :mod:`olv_runtime.ops` because a struct type's decoder is an ONNX
FunctionProto that runs on the operator registry (seed 000 "Decoders"); the representation it
decodes (catalogue, layouts, values) lives below, in :mod:`olv_runtime.structs`.

* :func:`resolve` - the validated model (:func:`olv_runtime.structs.value.resolve_values`), its
  seed 004 compiled entries checked (:func:`olv_runtime.structs.compiled.check_compiled`) and a
  decoder bound to every struct value (:func:`olv_runtime.decoding.decoders.bind_decoders`);
  cached per Model.
* :func:`register_native_decoder` - native decoders by type_id (verified against the resolved
  declaration first); FunctionProto decoders run by olv_runtime (:class:`FunctionDecoder`).
* :func:`decode_value`, :func:`to_decoded` - encoded versus decoded comparisons.
* :mod:`olv_runtime.decoding.ggml_native` - the GGUF block types' native decoders and linear forms.
"""
from __future__ import annotations

from olv_runtime.decoding.convert import decode_value, to_decoded  # noqa: F401
from olv_runtime.decoding.decoders import (  # noqa: F401
    FunctionDecoder,
    NativeDecoder,
    bind_decoders,
    native_decoders,
    register_native_decoder,
    resolve,
    unregister_native_decoder,
)
