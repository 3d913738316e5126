"""Object storage: checkpoints and data mirrors on fsspec URLs (s3:// first), beside the local paths
everything else uses."""

from workbench.storage.remote import (
    StorageError,
    check_url,
    check_writable,
    filesystem,
    is_remote,
    storage_options,
)

__all__ = [
    "StorageError",
    "check_url",
    "check_writable",
    "filesystem",
    "is_remote",
    "storage_options",
]
