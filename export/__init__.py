"""ONNX export of served MADE models and the torch-free runtime that serves them on devices.

* ``export.onnx_made``: ``ServedModel``, ``build_onnx``, ``export_served_model`` (onnx; torch lazily for parity)
* ``export.runtime``: ``MadeRuntime``, ``ModelWatcher``, ``load_inputs`` (numpy + onnxruntime only)
* ``export.snapshot``: ``save_snapshot`` / ``load_snapshot`` of ``served.npz`` (numpy only)
* ``export.cli``: the ``fcl export`` and ``fcl infer`` subcommands

Nothing is imported here so that ``import export.runtime`` stays light on a device.
"""
