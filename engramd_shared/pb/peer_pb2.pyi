from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FillRequest(_message.Message):
    __slots__ = ("open", "window", "proof", "piece", "done")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    open: FillOpen
    window: int
    proof: bytes
    piece: int
    done: int
    def __init__(self, open: _Optional[_Union[FillOpen, _Mapping]] = ..., window: _Optional[int] = ..., proof: _Optional[bytes] = ..., piece: _Optional[int] = ..., done: _Optional[int] = ...) -> None: ...

class FillOpen(_message.Message):
    __slots__ = ("set_id", "nonce")
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    set_id: str
    nonce: bytes
    def __init__(self, set_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class FillReply(_message.Message):
    __slots__ = ("offer", "granted", "proof", "piece", "missing", "holding", "busy")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    offer: SetOffer
    granted: int
    proof: ServerProof
    piece: int
    missing: int
    holding: bytes
    busy: int
    def __init__(self, offer: _Optional[_Union[SetOffer, _Mapping]] = ..., granted: _Optional[int] = ..., proof: _Optional[_Union[ServerProof, _Mapping]] = ..., piece: _Optional[int] = ..., missing: _Optional[int] = ..., holding: _Optional[bytes] = ..., busy: _Optional[int] = ...) -> None: ...

class ServerProof(_message.Message):
    __slots__ = ("nonce", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class SetOffer(_message.Message):
    __slots__ = ("manifest_json", "nixl_metadata", "regions", "attestation", "strong_digests", "piece_digests", "held")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    STRONG_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PIECE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    nixl_metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[RemoteRegion]
    attestation: str
    strong_digests: _containers.RepeatedScalarFieldContainer[str]
    piece_digests: _containers.RepeatedScalarFieldContainer[bytes]
    held: bytes
    def __init__(self, manifest_json: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[RemoteRegion, _Mapping]]] = ..., attestation: _Optional[str] = ..., strong_digests: _Optional[_Iterable[str]] = ..., piece_digests: _Optional[_Iterable[bytes]] = ..., held: _Optional[bytes] = ...) -> None: ...

class RemoteRegion(_message.Message):
    __slots__ = ("address", "nbytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    address: int
    nbytes: int
    def __init__(self, address: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...
