"""Built-in settings, one module per family; importing a module registers its settings.

Adding a family = one file here + one line below. The engine never names a concrete setting.
"""

from settings import (
    async_pipeline,  # noqa: F401
    calibration,  # noqa: F401
    conversion,  # noqa: F401
    ddp,  # noqa: F401
    determinism,  # noqa: F401
    device,  # noqa: F401  (last: it registers CUDA runs of settings registered above)
    fsdp,  # noqa: F401
    fsdp_legacy,  # noqa: F401
    fsdp_tp,  # noqa: F401
    partial_reduce,  # noqa: F401
    pipeline,  # noqa: F401
    quant_dense,  # noqa: F401
    quant_tensorflow,  # noqa: F401
    quant_torchrec,  # noqa: F401
    reference,  # noqa: F401
    repartition,  # noqa: F401
    resume,  # noqa: F401
    resume_tensorflow,  # noqa: F401
    tensor_parallel,  # noqa: F401
    tensorflow,  # noqa: F401
    torchrec_sharding,  # noqa: F401
)
