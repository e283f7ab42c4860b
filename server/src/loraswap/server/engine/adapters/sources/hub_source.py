"""The Hugging Face Hub (--allow-hub): hub-refs fetched with huggingface_hub into its own cache (HF_HUB_OFFLINE=1:
that cache only).
"""

from __future__ import annotations

from pathlib import Path

from loraswap.server.engine.adapters.sources.adapter_file import AdapterFile
from loraswap.server.engine.adapters.sources.adapter_folder import MODEL_CARD_NAME, check_file_size, pick_weight_file
from loraswap.server.engine.adapters.sources.adapter_names import HubRef
from loraswap.server.engine.errors import (
    AdapterFormatError,
    AdapterNameError,
    AdapterNotFoundError,
    ErrorReason,
    HubDisabledError,
    shorten,
)


class HubAdapterSource:
    """Adapters fetched with huggingface_hub into its normal cache (HF_HUB_OFFLINE=1: cache only)."""

    def __init__(self, allowed: bool, max_adapter_bytes: int = 0) -> None:
        self.allowed = allowed
        self.max_adapter_bytes = max_adapter_bytes

    def fetch(self, name: str, ref: HubRef) -> AdapterFile:
        """Download (or find in the cache) the adapter file for a hub-ref."""
        if not self.allowed:
            raise HubDisabledError(
                f"{shorten(name)!r} is not under the adapter directory and the server runs without --allow-hub; "
                "put the adapter in the adapter directory or start the server with --allow-hub"
            )
        from huggingface_hub import hf_hub_download, snapshot_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        try:
            if ref.weight_name:
                if not ref.weight_name.endswith(".safetensors"):
                    raise AdapterFormatError(
                        f"{shorten(ref.weight_name)} is not a .safetensors file; loraswap reads safetensors only",
                        reason=ErrorReason.ADAPTER_PICKLE_REFUSED,
                    )
                path = Path(hf_hub_download(ref.repo_id, ref.weight_name, revision=ref.revision))
                card = _hub_model_card(ref)
            else:
                folder = Path(
                    snapshot_download(
                        ref.repo_id, revision=ref.revision, allow_patterns=["*.safetensors", "*.bin", MODEL_CARD_NAME]
                    )
                )
                path = pick_weight_file(folder, name)
                card = folder / MODEL_CARD_NAME
        except HFValidationError as exc:
            raise AdapterNameError(f"{shorten(name)!r} is not a valid Hub reference: {shorten(exc)}") from exc
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError, LocalEntryNotFoundError) as exc:
            raise AdapterNotFoundError(
                f"adapter {shorten(name)!r} was not found on the Hub or in the local Hub cache: {type(exc).__name__}"
            ) from exc
        check_file_size(path, self.max_adapter_bytes)
        revision = ref.revision or "main"
        return AdapterFile(
            name=name,
            path=path,
            source=f"hf://{ref.repo_id}@{revision}/{path.name}",
            max_bytes=self.max_adapter_bytes,
            model_card=card if card is not None and card.is_file() else None,
        )


def _hub_model_card(ref: HubRef) -> Path | None:
    """The repo's README.md (one small file, from the Hub cache when it is there), or None."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(ref.repo_id, MODEL_CARD_NAME, revision=ref.revision))
    # The card is optional: a repo without one, an offline cache without it or a network error only mean
    # no declaration to check; the weights were found, and that is what the request needs.
    except Exception:  # noqa: BLE001 - huggingface_hub and its HTTP client raise many kinds; all mean "no card"
        return None
