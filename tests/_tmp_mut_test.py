import numpy as np, pytest
import export.onnx_made as om
@pytest.fixture(autouse=True)
def nomask(monkeypatch):
    real = om.mask_for_param
    def m(masks, name):
        r = real(masks, name)
        if r is None: return r
        r = r.copy(); 
        if name == "output.weight": r[:] = 1
        return r
    monkeypatch.setattr(om, "mask_for_param", m)
from test_export import test_onnx_graph_is_autoregressive, CASES
