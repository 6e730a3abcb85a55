"""``manifest.json``: the contract between the exporter and the runners.

A runner learns everything from it: the family and dims, special tokens and generation defaults,
which graphs to run once per input ("stages", e.g. encoder then cross K/V projection) and which
graph to run per step, where each graph input comes from, and the cache layout.

Every graph input names its source in ``from``:

* ``input:<role>``: what the user provides per input sequence (``input_ids``, ``attention_mask``,
  ``input_features``), batch B;
* ``<graph>:<output>``: an output of a stage graph, computed once per input, batch B;
* ``step:input_ids``: the decoder tokens of this step, [rows, t] with rows = B·beam;
* ``cache:<output>``: a self-attention cache entry, fed back from the decoder's own output
  (empty, length 0 along ``seq_axis``, at the first step).

Anything a search keeps per input sequence is "input-related state" (batch B, shared by the
beams); the ``cache:`` entries are the self-attention cache (batch rows, reordered with beams).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from elx.runners import manifest_schema
from elx.runners.errors import ElxError
from elx.runners.inputs.user_files import read_user_file
from elx.runners.manifest_schema import FORMAT, VERSION  # noqa: F401 - the exporter writes these

FILENAME = "manifest.json"


@dataclass
class Manifest:
    data: dict
    folder: Path | None = None

    # -- reading -------------------------------------------------------------------------
    @classmethod
    def load(cls, folder) -> "Manifest":
        folder = Path(folder)
        path = folder / FILENAME
        if not path.exists():
            raise ElxError(f"{folder} has no {FILENAME}; pass a folder written by 'elx export'")
        raw = read_user_file(path, "the export's")  # a regular file (a FIFO would block, a device never end)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ElxError(f"{path} is corrupted ({type(err).__name__}); re-run 'elx export' for this folder")
        manifest = cls(manifest_schema.loads(text, path), folder)
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """Every field the runners read, against ``runners/manifest_schema.py`` (one line naming the first bad
        field), then the graph files it names exist."""
        where = self.folder / FILENAME if self.folder else "manifest"
        manifest_schema.check(self.data, where)
        for name in [*self.stages, self.step]:
            file = self.data["graphs"][name]["file"]
            if self.folder is not None and not (self.folder / file).is_file():
                raise ElxError(f"{self.folder / file} is missing; re-run 'elx export' for this folder")

    def check_graph_io(self, name: str, inputs: dict, outputs: dict) -> None:
        """The loaded file of graph ``name`` has the inputs and outputs (name → ONNX type) described here."""
        where = self.folder / FILENAME if self.folder else "manifest"
        manifest_schema.check_graph_io(where, name, self.graphs[name], inputs, outputs)

    def save(self, folder) -> Path:
        path = Path(folder) / FILENAME
        path.write_text(json.dumps(self.data, indent=1, sort_keys=False) + "\n")
        return path

    def copy(self) -> "Manifest":
        return Manifest(json.loads(json.dumps(self.data)), self.folder)

    # -- convenient views ----------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.data["family"]

    @property
    def dims(self) -> dict:
        return self.data["dims"]

    @property
    def tokens(self) -> dict:
        return self.data["tokens"]

    @property
    def stages(self) -> list[str]:
        return list(self.data["stages"])

    @property
    def step(self) -> str:
        return self.data["step"]

    @property
    def graphs(self) -> dict:
        return self.data["graphs"]

    @property
    def cache_entries(self) -> list[dict]:
        """Self-attention cache entries: ``{"input", "output", "shape", "seq_axis"}``."""
        return list(self.data["cache"]["self"])

    @property
    def passes(self) -> list[dict]:
        return list(self.data["passes"])

    def pass_names(self) -> list[str]:
        return [p["name"] for p in self.data["passes"]]

    def graph_path(self, name: str) -> Path:
        return Path(self.folder) / self.graphs[name]["file"]

    def encoder_inputs(self) -> dict[str, dict]:
        """The user-provided inputs by role (``input:<role>`` sources), with dtype and shape."""
        found = {}
        for name in [*self.stages, self.step]:
            for spec in self.graphs[name]["inputs"].values():
                kind, _, role = spec["from"].partition(":")
                if kind == "input":
                    found[role] = spec
        return found

    def graph_files(self) -> list[str]:
        files = []
        for graph in self.graphs.values():
            files.append(graph["file"])
            files.extend(graph.get("external_data", []))
            if graph.get("tensorrt_file"):
                files.append(graph["tensorrt_file"])
        return files
