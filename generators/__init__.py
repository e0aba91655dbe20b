"""Model and input generators, registered by model kind. One line per generator module."""

from generators import dlrm  # noqa: F401  (registers kind "dlrm")
from generators import transformer  # noqa: F401  (registers kind "transformer")
from generators import torchrec_models  # noqa: F401  (registers kinds "torchrec-dlrm", "torchrec-deepfm")
from generators import sequential  # noqa: F401  (registers kind "sequential")
from generators import functional  # noqa: F401  (registers kinds "keras-dag", "keras-transformer")
from generators import zoo  # noqa: F401  (registers kinds "hf-<architecture>", "timm-<model>": the [zoo] extra)
from generators import titan  # noqa: F401  (registers kinds "titan-<model>": the [titan] extra)

# what the generators import lazily in every rank, loaded once into the server CPU ranks fork from
RANK_IMPORTS = ("torchrec", "onnx", "onnx2torch", "onnx2pytorch", "onnxruntime", "generators._tf_preload")
