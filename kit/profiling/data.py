"""Old name of kit.profiling.profile_data (what a loaded profile holds), kept so existing imports work."""

from kit.profiling.profile_data import (  # noqa: F401
    COMMUNICATION_CORES,
    KERNEL_COLUMNS,
    CaptureError,
    ProfileData,
    ProfileError,
)
