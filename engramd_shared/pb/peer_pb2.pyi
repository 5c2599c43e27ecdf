from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FillRequest(_message.Message):
    __slots__ = ("open", "window")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    open: FillOpen
    window: int
    def __init__(self, open: _Optional[_Union[FillOpen, _Mapping]] = ..., window: _Optional[int] = ...) -> None: ...

class FillOpen(_message.Message):
    __slots__ = ("token", "set_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SET_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    set_id: str
    def __init__(self, token: _Optional[str] = ..., set_id: _Optional[str] = ...) -> None: ...

class FillReply(_message.Message):
    __slots__ = ("offer", "granted")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    offer: SetOffer
    granted: int
    def __init__(self, offer: _Optional[_Union[SetOffer, _Mapping]] = ..., granted: _Optional[int] = ...) -> None: ...

class SetOffer(_message.Message):
    __slots__ = ("manifest_json", "nixl_metadata", "regions")
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    manifest_json: str
    nixl_metadata: bytes
    regions: _containers.RepeatedCompositeFieldContainer[RemoteRegion]
    def __init__(self, manifest_json: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[RemoteRegion, _Mapping]]] = ...) -> None: ...

class RemoteRegion(_message.Message):
    __slots__ = ("address", "nbytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    address: int
    nbytes: int
    def __init__(self, address: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...
