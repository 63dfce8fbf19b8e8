from typing import Literal

HookMode = Literal["preload", "torch"]
