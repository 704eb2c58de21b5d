"""Stand-in: the CANN version an Ascend host reports (a current release; MindSpeed picks its
code paths for CANN newer than 8.0.RC2 from it)."""

CANN_VERSION = "8.3.RC1"


def get_cann_version() -> str:
    return CANN_VERSION
