"""NGFL (seed 004): task alignment tables and heterogeneous class heads fused by label.

Work in progress (issue 17): the double-ended task alignment table (``table``), the
label-aligned fusion of class heads (``fusion``) and the growing head with its two losses
(``model``) are here and tested; the options, wire contract, strategy, learner and the
registration of the method are not written yet, so the runtimes do not know this package.
"""
