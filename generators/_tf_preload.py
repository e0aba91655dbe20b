"""Imported into the server CPU ranks and model builders fork from (`RANK_IMPORTS`): TensorFlow and the exporter,
imported there once, after torch as they must be, rather than in each process that needs them. A default job's
processes imported TensorFlow 17 times, 2-3 s each on 2 cores; the server now pays that once, and a sweep without
a Keras model pays it once too. Nothing runs: TensorFlow's runtime starts in the process that first runs an op."""

from generators import _tf

if _tf.missing() is None:
    _tf.import_tensorflow()
    import tf2onnx  # noqa: F401  (what a Keras model's build runs next)
