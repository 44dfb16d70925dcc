"""The served model with its LoRA adapters: loading, replacing, unloading, and one forward for a
batch whose rows use different adapters (or none)."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

from torch import nn

from lightning_core.backends.transformers_backend.requests import BASE
from lightning_core.errors import InvalidInput, NotFound
from lightning_core.security.adapter_folder import CONFIG_FILE, WEIGHTS_FILE, missing_modules


class Adapters:
    """A base model and the PEFT LoRA adapters loaded onto it, by public name.

    Every method runs on the engine thread except `ids` lookups. An adapter still used by a
    running request (see `hold`/`release`) is only retired when replaced or unloaded, and
    deleted once its last request leaves.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.peft: Any = None
        self.ids: dict[str, str] = {}  # public name -> PEFT adapter name
        # How the LoRA layers are set up (see _select_mode); None: unknown after a change.
        self._mode: str | None = None
        self._retired: set[str] = set()  # replaced or unloaded; deleted once unused
        self._users: Counter[str] = Counter()
        self._numbers = itertools.count()

    def unknown(self, name: str) -> str:
        loaded = ", ".join(sorted(self.ids)) or "none"
        return f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}); load it first"

    def hold(self, adapter_id: str) -> None:
        """A request starts using `adapter_id` (BASE for the base model)."""
        self._users[adapter_id] += 1

    def release(self, adapter_id: str) -> None:
        """A request stops using it; a retired adapter nobody uses any more is deleted."""
        self._users[adapter_id] -= 1
        self._collect()

    def forward(self, adapter_ids: list[str], **kwargs: Any) -> Any:
        """The model's output for a batch whose row i runs on adapter `adapter_ids[i]`."""
        if self.peft is None:
            return self.model(**kwargs)
        if (names := self._select_mode(adapter_ids)) is None:
            return self.peft(**kwargs)
        return self.peft(adapter_names=names, **kwargs)

    def _select_mode(self, adapter_ids: list[str]) -> list[str] | None:
        """Set the LoRA layers up for this batch; the `adapter_names` to pass, if mixed.

        PEFT's mixed-batch path gathers and scatters each adapter's rows in every LoRA layer
        (it cost SmolLM2 a third of its decode speed at batch 8). A batch on one adapter, the
        common case of an RL policy, takes the plain path with that adapter active, and an
        all-base batch runs with the adapters disabled. Switching walks every module, so it
        happens only when the batch's kind changes.
        """
        first = adapter_ids[0]
        mode = first if all(a == first for a in adapter_ids) else "mixed"
        if mode != self._mode:
            if mode == BASE:
                self.peft.base_model.disable_adapter_layers()
            else:
                self.peft.base_model.enable_adapter_layers()
                if mode != "mixed":
                    self.peft.set_adapter(mode, inference_mode=True)
            self._mode = mode
        return adapter_ids if mode == "mixed" else None

    def load(self, name: str, path: str) -> None:
        from peft import PeftConfig, PeftModel

        self._check_folder(Path(path))
        try:
            adapter_config = PeftConfig.from_pretrained(path)
        except Exception as exc:
            raise InvalidInput(
                f"{path} is not a PEFT adapter folder ({exc}); save one with save_pretrained"
            ) from exc
        if str(adapter_config.peft_type) not in ("LORA", "PeftType.LORA"):
            raise InvalidInput(f"{path} holds a {adapter_config.peft_type} adapter, not LoRA")
        targets = adapter_config.target_modules
        if isinstance(targets, str):
            raise InvalidInput(f"{path}: target_modules must list module names, not a pattern")
        missing = missing_modules(targets or [], (n for n, _ in self.model.named_modules()))
        if missing:
            raise InvalidInput(
                f"{path}: target_modules {missing} name no module of the served model; is the "
                "adapter for another model?"
            )
        # PEFT names must be valid module names, and requests already running on an adapter
        # being replaced keep the weights they started with: each load gets a fresh name.
        adapter_id = f"lora{next(self._numbers)}"
        # What PeftModel.from_pretrained does, in two steps so that a failed load (missing
        # weights, an adapter of another model) leaves no LoRA layers behind in the model.
        peft = self.peft or PeftModel(self.model, adapter_config, adapter_name=adapter_id)
        try:
            peft.load_adapter(path, adapter_name=adapter_id)
        except Exception as exc:
            if self.peft is None:
                self.model = peft.unload()
            elif adapter_id in peft.peft_config:
                peft.delete_adapter(adapter_id)
            raise InvalidInput(f"cannot load LoRA adapter {name!r} from {path}: {exc}") from exc
        self.peft = peft.eval()
        self._mode = None
        previous = self.ids.get(name)
        self.ids[name] = adapter_id
        if previous is not None:
            self._retired.add(previous)
            self._collect()

    @staticmethod
    def _check_folder(folder: Path) -> None:
        # Before PEFT sees the path: PEFT takes a path that is no folder for a Hub id and
        # retries the Hub (23 s, the engine thread and so every generation waiting), and
        # loads adapter_model.bin, a pickle, when there is no safetensors file.
        if not folder.is_absolute() or not folder.is_dir():
            raise InvalidInput(
                f"{folder} is not the absolute path of a local folder: adapters are loaded from "
                "local folders only, never from the Hub"
            )
        if not (folder / CONFIG_FILE).is_file():
            raise InvalidInput(
                f"{folder} is not a PEFT adapter folder (no {CONFIG_FILE}); save one with "
                "save_pretrained"
            )
        if not (folder / WEIGHTS_FILE).is_file():
            raise InvalidInput(
                f"{folder} has no {WEIGHTS_FILE}; pickled weights (adapter_model.bin) are never "
                "loaded: save the adapter with save_pretrained(safe_serialization=True)"
            )

    def unload(self, name: str) -> None:
        adapter_id = self.ids.pop(name, None)
        if adapter_id is None:
            raise NotFound(self.unknown(name))
        self._retired.add(adapter_id)
        self._collect()

    def _collect(self) -> None:
        for adapter_id in [a for a in self._retired if self._users[a] <= 0]:
            self._retired.discard(adapter_id)
            if len(self.peft.peft_config) == 1:
                # The last adapter: unwrap, so batches run the plain model again.
                self.model = self.peft.unload()
                self.peft = None
            else:
                if adapter_id in self.peft.active_adapters:
                    # PEFT would hand "active" on itself, with a warning; _select_mode sets
                    # the active adapter again before the next forward anyway.
                    staying = next(a for a in self.peft.peft_config if a != adapter_id)
                    self.peft.set_adapter(staying, inference_mode=True)
                self.peft.delete_adapter(adapter_id)
            self._mode = None
