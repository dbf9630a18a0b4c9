"""megatron_fsdp: fully sharded data parallelism in the Megatron style, on CPU and CUDA."""

from .comm.collectives import CollectiveRecorder, record_collectives
from .config import DistributedDataParallelConfig
from .mcore_fsdp_adapter import FullyShardedDataParallel
from .comm.distributed_index import FSDPDistributedIndex
from .enums import BucketStatus, ShardingStrategy, TrainingState
from .fully_shard import fully_shard, fully_shard_model, fully_shard_optimizer
from .param_marks import fsdp_no_shard
from .megatron_fsdp import MegatronFSDP
from .mixed_precision import MixedPrecisionPolicy
from .state.checkpoint import load_checkpoint, save_checkpoint
from .state.model_state_dict import StateDictMismatchError, get_full_state_dict, load_full_state_dict, save_full_state_dict
from . import uneven_dtensor, utils  # upstream's module names (Megatron-LM imports helpers from them)

__all__ = [
    "BucketStatus",
    "CollectiveRecorder",
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "FullyShardedDataParallel",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "ShardingStrategy",
    "TrainingState",
    "fsdp_no_shard",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "StateDictMismatchError",
    "get_full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
    "save_full_state_dict",
    "record_collectives",
]

__version__ = "0.1.0"
