"""The load pipeline: :func:`load_rank` (plan → set up → read → decode → place → verify → tear down).

- :mod:`.load`: the pipeline itself;
- :mod:`.decode`: the decode stage (staging buffers, nvCOMP or zstandard);
- :mod:`.config`: :class:`LoadConfig`, its options and ``GDSLOAD_*`` variables;
- :mod:`.result`: :class:`LoadResult` and its :class:`LoadReport`.
"""

from .config import LoadConfig
from .load import load_rank
from .result import PHASES, FileReport, LoadReport, LoadResult, Slot

__all__ = ["load_rank", "LoadConfig", "LoadResult", "LoadReport", "FileReport", "Slot", "PHASES"]
