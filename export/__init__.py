"""ONNX export of served MADE models and the torch-free runtime that serves them on devices.

* ``export.formats``: the served-format registry (``REGISTRY``: ``made``, ``text-groups``,
  ``text-tasks``, ``image-classifier``, each with its exporter and runtime) and ``export_served``
* ``export.publish``: the shared seal / write / verify / atomic-replace path (``ExportError``, ``seal``, ...)
* ``export.scaffold``: what every exporter does the same way (destination checks, staging,
  reloading the written file, logit parity, reports, the int8 classifier copy)
* ``export.onnx_made``: ``build_onnx``, ``export_served_model`` (onnx; torch lazily for parity)
* ``export.onnx_text_groups``: the text-groups classifier (torch): ``export_text_groups``,
  ``export_text_classifier``; its graphs in ``export.text_groups_graph``, their tracing and the
  torch reference in ``export.text_groups_build``, the torch-free checks in ``export.text_groups_verify``
* ``export.onnx_text_tasks``: the text-tasks classifier (torch): ``export_text_tasks``
* ``export.text_tasks_runtime``: ``TextTasksRuntime`` (numpy + onnxruntime + tokenizers only)
* ``export.text_runtime``: ``TextClassifierRuntime`` (numpy + onnxruntime + tokenizers only)
* ``export.onnx_image``: the image-classifier format (onnx only, no torch): ``export_image_classifier``
* ``export.image_runtime``: ``ImageClassifierRuntime`` (numpy + onnxruntime only)
* ``export.runtime``: ``MadeRuntime``, ``load_inputs`` (numpy + onnxruntime only)
* ``export.watcher``: ``ModelWatcher``, which swaps in a changed model file (numpy + onnxruntime only)
* ``export.snapshot``: ``save_snapshot`` / ``load_snapshot`` of ``served.npz`` (numpy only)
* ``export.cli``: the ``fcl export`` and ``fcl infer`` subcommands (``fcl infer`` in ``export.infer_cli``)

Nothing is imported here so that ``import export.runtime`` stays light on a device.
"""
