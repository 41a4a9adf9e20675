"""Methods vLLM mixes into its worker (engine argument `worker_extension_cls`), for the engine replica to call
through `AsyncLLM.collective_rpc`: facts about the loaded model that the replica would otherwise have to assume.
The worker runs in vLLM's EngineCore process (on the GPU another process than the replica's), so the answers are
plain lists and dicts."""

from __future__ import annotations

EXTENSION = "service.engine.vllm.worker_ext.OCRWorkerExtension"


class OCRWorkerExtension:
    def ocr_lora_layers(self) -> dict[str, dict]:
        """The LoRA layers vLLM built, by the last part of their module name (`qkv_proj`). `linear`: the linear
        layers with the numbers of slices each kind has (3 where q, k and v are packed into one layer, 1 for a layer
        of its own), which the LoRA warm-up's kernel shapes assume (service.engine.vllm.lora.PACKED_LAYERS);
        `other`: the rest (an embedding's LoRA layer, say) with their class names."""
        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        linear: dict[str, set[int]] = {}
        other: dict[str, str] = {}
        for name, layer in manager.modules.items():
            kind = name.rsplit(".", 1)[-1]
            # getattr on a layer without slices reaches its base layer's __getattr__, which raises AttributeError
            slices = getattr(layer, "n_slices", None)
            if slices is None:
                other[kind] = type(layer).__name__
            else:
                linear.setdefault(kind, set()).add(int(slices))
        return {"linear": {kind: sorted(counts) for kind, counts in sorted(linear.items())},
                "other": dict(sorted(other.items()))}
