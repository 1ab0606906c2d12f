"""Triton's protos (README.md beside this file says where they come from), generated
into a descriptor pool of this package's own.

``tritonclient.grpc`` registers the same messages (``inference.ModelInferRequest``, ...)
in protobuf's default pool, from files of its own version; generated into that pool too,
a process importing both would fail with "duplicate symbol" (or "duplicate file name")
as soon as the two versions differ. Messages of separate pools never meet: what travels
is bytes. Regenerate with ``python -m zeroserve.models.proto.generate``.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
