"""
What the multilingual build's loader needs so that a load reaches no network: its
tokenizer's two downloads, answered from what a fetch already put on the disk, or not made.

chatterbox-tts's C{MTLTokenizer} builds a C{ChineseCangjieConverter} whenever it is made,
that is inside C{ChatterboxMultilingualTTS.from_local}, and the converter

 - calls C{hf_hub_download(repo_id="ResembleAI/chatterbox", filename="Cangjie5_TC.json",
   cache_dir=<the checkpoint folder>)}: at the branch C{main}, not the commit the adapter
   pinned, asking the hub, into a cache inside the snapshot folder;
 - makes C{spacy_pkuseg.pkuseg()}, whose default model (C{spacy_ontonotes}) is
   downloaded from GitHub into C{~/.pkuseg} the first time; the converter catches only
   an C{ImportError} there, so on a box that cannot reach GitHub the whole load fails.

L{offline_tokenizer} wraps the load: the module's C{hf_hub_download} answers through the
hub's own client, C{local_files_only}, at the pinned commit in the hub's cache (where
L{rhapsode_worker.hub.fetch} put the snapshot's C{Cangjie5_TC.json}), and refuses any
other file; C{spacy_pkuseg} cannot be imported for the length of the load, so the
converter takes its own path for a box without it (no word segmentation; a warning).  The
library's loading code runs unchanged and no installed file is changed: the two names are
replaced for the load and put back after it.  Chinese is not declared, since its text
would reach the model unsegmented (docs/engines/chatterbox.md).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from fnmatch import fnmatch
from typing import Any, Iterator, Mapping

from rhapsode_worker.hub import HubSnapshot, hub_cache

#: The segmenter package the tokenizer would download a model for.
SEGMENTER = "spacy_pkuseg"
_ABSENT = object()


class Served:
    """
    What the tokenizer asked of the hub during one load, and what it was given.
    """

    def __init__(self) -> None:
        self.files: list[str] = []
        self.refused: list[str] = []


@contextmanager
def offline_tokenizer(snapshot: HubSnapshot, environ: Mapping[str, str]) -> Iterator[Served]:
    """
    For the length of a multilingual load: the tokenizer's hub downloads come from the
    pinned snapshot in the hub's cache, without the network, and its segmenter's
    download is not made.  Not reentrant; a worker loads one model at a time.
    """
    from chatterbox.models.tokenizers import tokenizer as module
    from huggingface_hub import hf_hub_download

    served = Served()
    cache = str(hub_cache(environ))

    def pinned(repo_id: str, filename: str, **_: Any) -> str:
        if repo_id != snapshot.repo or not any(fnmatch(filename, p) for p in snapshot.files):
            served.refused.append(f"{repo_id}/{filename}")
            raise FileNotFoundError(f"{repo_id}/{filename} is not among the files of {snapshot.repo}@"
                                    f"{snapshot.revision} that the adapter fetched")
        path: str = hf_hub_download(repo_id, filename, repo_type=snapshot.repo_type, revision=snapshot.revision,
                                    cache_dir=cache, local_files_only=True)
        served.files.append(path)
        return path

    real = module.hf_hub_download
    segmenter = sys.modules.get(SEGMENTER, _ABSENT)
    module.hf_hub_download = pinned
    # A None in sys.modules makes an import of the name raise ImportError.
    sys.modules[SEGMENTER] = None  # type: ignore[assignment]
    try:
        yield served
    finally:
        module.hf_hub_download = real
        if segmenter is _ABSENT:
            sys.modules.pop(SEGMENTER, None)
        else:
            sys.modules[SEGMENTER] = segmenter  # type: ignore[assignment]
