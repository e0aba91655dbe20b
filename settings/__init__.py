"""Built-in settings, one module per family; importing a module registers its settings.

Adding a family = one file here + one line below. The engine never names a concrete setting.
"""

from settings import reference  # noqa: F401
from settings import torchrec_sharding  # noqa: F401
from settings import torchrec_optimizers  # noqa: F401
from settings import torchrec_reshard  # noqa: F401
from settings import torchrec_clipping  # noqa: F401
from settings import torchrec_qcomms  # noqa: F401
from settings import torchrec_vbe  # noqa: F401
from settings import torchrec_pipelines  # noqa: F401
from settings import torchrec_sequence  # noqa: F401
from settings import torchrec_collision  # noqa: F401
from settings import ddp  # noqa: F401
from settings import tensorflow  # noqa: F401
from settings import conversion  # noqa: F401
from settings import quant_torchrec  # noqa: F401
from settings import quant_dense  # noqa: F401
from settings import quant_tensorflow  # noqa: F401
from settings import fsdp  # noqa: F401
from settings import fsdp_legacy  # noqa: F401
from settings import tensor_parallel  # noqa: F401
from settings import fsdp_tp  # noqa: F401
from settings import pipeline  # noqa: F401
from settings import determinism  # noqa: F401
from settings import calibration  # noqa: F401
from settings import resume  # noqa: F401
from settings import repartition  # noqa: F401
from settings import partial_reduce  # noqa: F401
from settings import async_pipeline  # noqa: F401
from settings import resume_tensorflow  # noqa: F401
from settings import activation_checkpointing  # noqa: F401
from settings import gradient_clipping  # noqa: F401
from settings import dense_optimizers  # noqa: F401
from settings import accumulation  # noqa: F401
from settings import compiled  # noqa: F401
from settings import titan  # noqa: F401
from settings import hf_distributed  # noqa: F401
from settings import dtensor_spmd  # noqa: F401
from settings import device  # noqa: F401  (last: it registers CUDA runs of settings registered above)

# what the settings import lazily in every rank, loaded once into the server CPU ranks fork from
RANK_IMPORTS = ("torchrec", "torch.distributed.checkpoint")
