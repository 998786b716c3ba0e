"""The trained model saved with what rebuilds it, and brought back (melissa_dl.serving.saved): ``load_model`` in a
Python session, ``model.ts`` through TorchScript, and the refusals."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from melissa_dl import load_model
from melissa_dl.config.sections import TrainingConfig, WindowConfig
from melissa_dl.errors import ConfigError
from melissa_dl.serving.saved import save
from melissa_dl.train.module import TrainingModule, check_prediction_inputs, load_module_class

pytestmark = pytest.mark.timeout(60)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
HEAT = EXAMPLES / "heat_pde" / "surrogate.py"
NODES = EXAMPLES / "node_features" / "model.py"

OWN = '''
import torch
from torch import nn
from melissa_dl import TrainingModule


class Doubler(TrainingModule):
    """y = 2 x + b, with what a test asks of its predict."""

    def __init__(self, width: int = 3, frozen_batch: bool = False, declared: bool = True):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))
        self.frozen_batch = frozen_batch
        if declared:
            self.prediction_inputs = {"x": ("float32", (width,))}

    def forward(self, x):
        y = 2 * x + self.bias
        return y.reshape(2, -1) if self.frozen_batch else y  # a batch size frozen into the trace

    def configure_optimizer(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def process(self, sample):
        return sample.fields["x"]

    def training_step(self, batch):
        return self(batch).pow(2).mean()
'''


def training(module: Path, class_name: str, **options: object) -> TrainingConfig:
    return TrainingConfig(module=str(module), class_name=class_name, options=dict(options))


def saved_module(folder: Path, file: Path, class_name: str, batches: int = 7, **options: object) -> TrainingModule:
    """A module of ``file`` with random parameters, saved into ``folder`` as a study saves its model (a table's
    ``_extra_state``, its row range, left out: ``Trainer.model_state``)."""
    torch.manual_seed(1)
    module = load_module_class(file, class_name)(**options)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter)
    state = {key: value for key, value in module.state_dict().items() if not key.endswith("._extra_state")}
    save(folder, state, training(file, class_name, **options), file, batches, module.prediction_inputs)
    return module.eval()


@pytest.fixture
def own(tmp_path: Path) -> Path:
    file = tmp_path / "own_module.py"
    file.write_text(textwrap.dedent(OWN))
    return file


def heat_questions(n: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(3)
    return {
        "parameters": torch.from_numpy(rng.uniform(100, 500, (n, 5)).astype(np.float32)),
        "time_step": torch.from_numpy(rng.integers(0, 100, n).astype(np.float32)),
    }


def test_the_heat_surrogate_comes_back_in_python_and_in_torchscript_with_the_same_answers(tmp_path: Path) -> None:
    module = saved_module(tmp_path, HEAT, "HeatSurrogate", hidden=16, depth=2, nx=8, ny=6)
    saved = json.loads((tmp_path / "model.json").read_text())
    assert saved["batches"] == 7 and saved["class_name"] == "HeatSurrogate" and saved["module"] == str(HEAT)
    assert saved["options"] == {"hidden": 16, "depth": 2, "nx": 8, "ny": 6} and saved["window"] is None
    assert saved["inputs"] == {"parameters": ["float32", [5]], "time_step": ["float32", []]}
    assert saved["outputs"] == ["temperature"] and saved["torchscript"] == "model.ts"
    questions = heat_questions(5)
    with torch.no_grad():
        expected = module.predict(questions)["temperature"]
        loaded = load_model(tmp_path)
        assert not loaded.training
        torch.testing.assert_close(loaded.predict(questions)["temperature"], expected, rtol=0, atol=0)
        with pytest.warns(DeprecationWarning):  # torch 2.13 deprecates TorchScript; FTorch and C++ still load it
            scripted = torch.jit.load(str(tmp_path / "model.ts"))
        torch.testing.assert_close(scripted(questions["parameters"], questions["time_step"]), expected)


def test_the_heat_surrogates_predict_is_what_it_trains_on_in_kelvin(tmp_path: Path) -> None:
    """``predict`` normalises in torch as ``process`` does in numpy, and gives the field back in kelvin."""
    module = saved_module(tmp_path, HEAT, "HeatSurrogate", hidden=16, depth=2, nx=8, ny=6)
    questions = heat_questions(3)
    with torch.no_grad():
        predicted = module.predict(questions)["temperature"].numpy()
        for i in range(3):
            x = module.inputs(questions["parameters"][i].double().numpy(), int(questions["time_step"][i]))
            trained = module(torch.from_numpy(x)[None])[0].numpy() * module.temp_scale + module.temp_mid
            np.testing.assert_allclose(predicted[i], trained.reshape(8, 6), rtol=1e-5, atol=1e-3)


def test_a_module_with_a_table_comes_back_whole_on_one_process(tmp_path: Path) -> None:
    """The node-features surrogate's embedding table, whole in model.pt, is whole in the rebuilt module, which
    answers as the module that was saved, and so does its TorchScript (one process: the lookup is a plain
    gather)."""
    options = {"nx": 6, "ny": 5, "hidden": 8, "depth": 1, "dim": 4, "nodes_per_sample": 10}
    module = saved_module(tmp_path, NODES, "NodeFieldSurrogate", **options)
    loaded = load_model(tmp_path)
    torch.testing.assert_close(loaded.embedding.shard, module.embedding.shard, rtol=0, atol=0)
    assert loaded.embedding.shard.shape == (30, 4)
    questions = heat_questions(2)
    with torch.no_grad():
        expected = module.predict(questions)
        torch.testing.assert_close(loaded.predict(questions), expected, rtol=0, atol=0)
        with pytest.warns(DeprecationWarning):
            scripted = torch.jit.load(str(tmp_path / "model.ts"))
        torch.testing.assert_close(scripted(*questions.values()), expected["temperature"])


def test_a_module_that_declares_no_inputs_is_saved_without_torchscript(tmp_path: Path, own: Path) -> None:
    saved_module(tmp_path, own, "Doubler", declared=False)
    saved = json.loads((tmp_path / "model.json").read_text())
    assert saved["inputs"] is None and saved["torchscript"] is None and not (tmp_path / "model.ts").exists()
    with torch.no_grad():  # forward, named "output", by default
        answer = load_model(tmp_path).predict({"x": torch.ones(4, 3)})
    assert list(answer) == ["output"] and answer["output"].shape == (4, 3)


def test_a_trace_that_froze_its_batch_size_is_not_written(
    tmp_path: Path, own: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        saved_module(tmp_path, own, "Doubler", frozen_batch=True)
    assert not (tmp_path / "model.ts").exists()
    assert json.loads((tmp_path / "model.json").read_text())["torchscript"] is None
    assert "model.ts not written: Doubler's predict does not trace" in caplog.text


def test_a_window_comes_back_as_the_study_set_it(tmp_path: Path, own: Path) -> None:
    config = training(own, "Doubler")
    config.window = WindowConfig(inputs=4, targets=2, stride=1, block=64)
    module = load_module_class(own, "Doubler")()
    save(tmp_path, module.state_dict(), config, own, 0, module.prediction_inputs)
    assert load_model(tmp_path).window == config.window


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ({"x": ("float31", (3,))}, "Doubler.prediction_inputs['x']: dtype 'float31' is not one of float32"),
        ({"x": ("float32", (0,))}, "Doubler.prediction_inputs['x']: shape (0,) is not a tuple of fewer than 6"),
        ({"x": "float32"}, "Doubler.prediction_inputs['x']: expected (dtype, shape), got 'float32'"),
    ],
)
def test_a_wrong_declaration_of_the_inputs_is_refused_naming_it(own: Path, inputs: dict, says: str) -> None:
    module = load_module_class(own, "Doubler")()
    module.prediction_inputs = inputs
    with pytest.raises(ConfigError, match="^" + __import__("re").escape(says)):
        check_prediction_inputs(module)


def test_an_output_folder_without_a_saved_model_is_refused_in_one_line(tmp_path: Path, own: Path) -> None:
    with pytest.raises(ConfigError, match=r"/model\.json: missing \(a study writes model\.pt and model\.json at its"):
        load_model(tmp_path)
    saved_module(tmp_path, own, "Doubler")
    (tmp_path / "model.pt").unlink()
    with pytest.raises(ConfigError, match=r"/model\.pt: missing \("):
        load_model(tmp_path)


def test_a_module_file_moved_since_the_study_is_named_as_model_json_names_it(tmp_path: Path, own: Path) -> None:
    saved_module(tmp_path, own, "Doubler")
    own.rename(tmp_path / "elsewhere.py")
    with pytest.raises(ConfigError, match=rf"^model\.json's module {own}: no file "):
        load_model(tmp_path)


def test_a_trace_of_an_earlier_model_does_not_outlive_it(tmp_path: Path, own: Path) -> None:
    """Saved again (a re-export, a resumed study) by a module whose predict no longer traces: its model.ts goes."""
    saved_module(tmp_path, own, "Doubler")
    assert (tmp_path / "model.ts").exists()
    saved_module(tmp_path, own, "Doubler", frozen_batch=True)
    assert not (tmp_path / "model.ts").exists()


def test_a_predict_that_returns_a_tensor_is_told_to_return_a_mapping(
    tmp_path: Path, own: Path, caplog: pytest.LogCaptureFixture
) -> None:
    own.write_text(textwrap.dedent(OWN) + "\n    def predict(self, inputs):\n        return self(**inputs)\n")
    with caplog.at_level(logging.WARNING):
        saved_module(tmp_path, own, "Doubler")
    assert "does not trace (predict returned Tensor, not a mapping of name to tensor)" in caplog.text
    assert not (tmp_path / "model.ts").exists()


def test_a_module_file_changed_since_the_study_is_named(tmp_path: Path, own: Path) -> None:
    saved_module(tmp_path, own, "Doubler")
    own.write_text(textwrap.dedent(OWN).replace("self.bias = nn.Parameter", "self.offset = nn.Parameter"))
    sys.modules.pop("own_module", None)
    with pytest.raises(ConfigError, match=r"model\.pt does not match Doubler of .*own_module\.py \(missing \['offset'"):
        load_model(tmp_path)
    json_file = tmp_path / "model.json"  # a size changed: the same one line, with torch's words
    json_file.write_text(json_file.read_text().replace('"options": {}', '"options": {"width": 4}'))
    own.write_text(textwrap.dedent(OWN))
    sys.modules.pop("own_module", None)
    with pytest.raises(ConfigError, match=r"model\.pt does not match Doubler .*size mismatch for bias.*changed since"):
        load_model(tmp_path)
