from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INVALID_NODE: _ClassVar[NodeType]
    MEM_LOAD_NODE: _ClassVar[NodeType]
    MEM_STORE_NODE: _ClassVar[NodeType]
    COMP_NODE: _ClassVar[NodeType]
    COMM_SEND_NODE: _ClassVar[NodeType]
    COMM_RECV_NODE: _ClassVar[NodeType]
    COMM_COLL_NODE: _ClassVar[NodeType]

class MemoryType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INVALID_MEMORY: _ClassVar[MemoryType]
    LOCAL_MEMORY: _ClassVar[MemoryType]
    REMOTE_MEMORY: _ClassVar[MemoryType]

class CollectiveCommType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INVALID_COMM: _ClassVar[CollectiveCommType]
    ALL_REDUCE: _ClassVar[CollectiveCommType]
    ALL_TO_ALL: _ClassVar[CollectiveCommType]
    ALL_GATHER: _ClassVar[CollectiveCommType]
    REDUCE_SCATTER: _ClassVar[CollectiveCommType]
INVALID_NODE: NodeType
MEM_LOAD_NODE: NodeType
MEM_STORE_NODE: NodeType
COMP_NODE: NodeType
COMM_SEND_NODE: NodeType
COMM_RECV_NODE: NodeType
COMM_COLL_NODE: NodeType
INVALID_MEMORY: MemoryType
LOCAL_MEMORY: MemoryType
REMOTE_MEMORY: MemoryType
INVALID_COMM: CollectiveCommType
ALL_REDUCE: CollectiveCommType
ALL_TO_ALL: CollectiveCommType
ALL_GATHER: CollectiveCommType
REDUCE_SCATTER: CollectiveCommType

class Node(_message.Message):
    __slots__ = ("id", "name", "node_type", "parent", "tensor_loc", "tensor_size", "simulated_run_time", "input_tensor_loc", "input_tensor_size", "output_tensor_loc", "output_tensor_size", "num_ops", "comm_type", "involved_dim", "communicator_id", "comm_src", "comm_dst", "comm_size", "comm_tag", "comm_priority")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_TYPE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_LOC_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_RUN_TIME_FIELD_NUMBER: _ClassVar[int]
    INPUT_TENSOR_LOC_FIELD_NUMBER: _ClassVar[int]
    INPUT_TENSOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TENSOR_LOC_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TENSOR_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_OPS_FIELD_NUMBER: _ClassVar[int]
    COMM_TYPE_FIELD_NUMBER: _ClassVar[int]
    INVOLVED_DIM_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATOR_ID_FIELD_NUMBER: _ClassVar[int]
    COMM_SRC_FIELD_NUMBER: _ClassVar[int]
    COMM_DST_FIELD_NUMBER: _ClassVar[int]
    COMM_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMM_TAG_FIELD_NUMBER: _ClassVar[int]
    COMM_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    node_type: NodeType
    parent: _containers.RepeatedScalarFieldContainer[int]
    tensor_loc: MemoryType
    tensor_size: int
    simulated_run_time: int
    input_tensor_loc: MemoryType
    input_tensor_size: int
    output_tensor_loc: MemoryType
    output_tensor_size: int
    num_ops: int
    comm_type: CollectiveCommType
    involved_dim: _containers.RepeatedScalarFieldContainer[bool]
    communicator_id: int
    comm_src: int
    comm_dst: int
    comm_size: int
    comm_tag: int
    comm_priority: int
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., node_type: _Optional[_Union[NodeType, str]] = ..., parent: _Optional[_Iterable[int]] = ..., tensor_loc: _Optional[_Union[MemoryType, str]] = ..., tensor_size: _Optional[int] = ..., simulated_run_time: _Optional[int] = ..., input_tensor_loc: _Optional[_Union[MemoryType, str]] = ..., input_tensor_size: _Optional[int] = ..., output_tensor_loc: _Optional[_Union[MemoryType, str]] = ..., output_tensor_size: _Optional[int] = ..., num_ops: _Optional[int] = ..., comm_type: _Optional[_Union[CollectiveCommType, str]] = ..., involved_dim: _Optional[_Iterable[bool]] = ..., communicator_id: _Optional[int] = ..., comm_src: _Optional[int] = ..., comm_dst: _Optional[int] = ..., comm_size: _Optional[int] = ..., comm_tag: _Optional[int] = ..., comm_priority: _Optional[int] = ...) -> None: ...
