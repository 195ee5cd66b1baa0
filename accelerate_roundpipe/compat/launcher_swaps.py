"""The module attributes the stock-script launcher swaps (`launch/install.py`) ([Note: compatibility reaches]).
Written against accelerate 1.15 and transformers 5.24."""

from __future__ import annotations

import importlib

from . import LibraryChangedError

# (module, attribute): where a stock script finds the class it builds. The module's own definition comes first, the
# re-export after it (both are swapped, so either import path gets RoundPipe's class).
SWAPPED = (
    ("accelerate.accelerator", "Accelerator"),
    ("accelerate", "Accelerator"),
    ("transformers.trainer", "Trainer"),
    ("transformers", "Trainer"),
    ("transformers.training_args", "TrainingArguments"),
    ("transformers", "TrainingArguments"),
)


def swap_target(module_name: str, attribute: str, replacement: type) -> object:
    """What `module.attribute` holds now, checked to be the class `replacement` is built on (or `replacement`
    itself, when already installed): a library that moved or renamed the class would leave the launcher swapping a
    name no script uses any more."""
    library = module_name.split(".")[0]
    reach = f"{module_name}.{attribute}, swapped for {replacement.__qualname__} under stock scripts"
    try:
        module = importlib.import_module(module_name)
        current = getattr(module, attribute)
    except (ImportError, AttributeError) as error:
        raise LibraryChangedError(library, reach, f"it cannot be found ({error})") from None
    if current is not replacement and not (isinstance(current, type) and issubclass(replacement, current)):
        raise LibraryChangedError(library, reach, f"it is {current!r}, not the class {replacement.__qualname__} "
                                                  f"is built on")
    return current
