"""Struct field transport in graphs: ``olv.StructGet`` and ``olv.StructMake`` (since version 1).

* ``olv.StructGet(struct) -> field values`` with attribute ``fields`` (list of field names): the
  field values themselves (the same array / encoded / sequence objects: no copy).
* ``olv.StructMake(values...) -> struct`` with attribute ``fields``: a new
  :class:`~olv_runtime.structs.runtime.RuntimeStruct` holding the given values as they are.

With them a graph passes some fields of a retained struct through unchanged (the next value's
field is the same buffer) while computing others (seed 000 "Whole structured inputs").
"""
from __future__ import annotations

from olv_runtime.errors import ValidationError
from olv_runtime.ops.registry import Op, register
from olv_runtime.pool import current as current_pool
from olv_runtime.structs.runtime import RuntimeStruct, field_arrays


@register("StructGet", 1, domain="olv")
class StructGet(Op):
    accepts_structured = True
    attributes = {"fields": Op.REQUIRED}

    def setup(self, info):
        if len(self.attrs["fields"]) != len(self.node.output):
            raise ValidationError(f"node {self.name!r} (StructGet): {len(self.attrs['fields'])} "
                                  f"fields for {len(self.node.output)} outputs")

    def run(self, struct):
        if not isinstance(struct, RuntimeStruct):
            raise self.fail(f"input must be a struct value, got {type(struct).__name__}")
        try:
            return tuple(struct[f] for f in self.attrs["fields"])
        except KeyError as exc:
            raise self.fail(str(exc.args[0])) from None


@register("StructMake", 1, domain="olv")
class StructMake(Op):
    attributes = {"fields": Op.REQUIRED}

    def setup(self, info):
        if len(self.attrs["fields"]) != len(self.node.input):
            raise ValidationError(f"node {self.name!r} (StructMake): {len(self.attrs['fields'])} "
                                  f"fields for {len(self.node.input)} inputs")

    def run(self, *values):
        # Field arrays taken from the activation pool now belong to the struct: they leave the
        # pool (never recycled while the struct may be retained), as graph outputs do.
        pool = current_pool()
        if pool is not None:
            pool.escape(field_arrays(RuntimeStruct(dict(enumerate(values)))))
        return (RuntimeStruct(dict(zip(self.attrs["fields"], values))),)
