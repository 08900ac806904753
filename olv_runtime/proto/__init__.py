"""Generated protobuf bindings of ``proto/onnx_light.proto`` (seed 000 wire contract).

The messages are re-exported here: ``ModelProto``, ``GraphProto``, ``NodeProto``,
``TensorProto``, ``TypeProto``, ``ValueInfoProto``, ``AttributeProto``,
``EncodedValueProto``, ``AffineLayoutProto``, ``StructTypeProto``,
``PersistentBindingProto`` and the rest of onnx-ml.proto.
"""
from olv_runtime.proto import onnx_light_pb2 as pb  # noqa: F401
from olv_runtime.proto.onnx_light_pb2 import *  # noqa: F401,F403
