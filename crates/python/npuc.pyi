"""npuc: compile, quantize, verify and run ONNX/GGUF models on CPU (the `npuc` CLI as a library).

Keyword options are the CLI's flags with underscores: ``npuc.compile(m, o, input_shape={"x":
[1, 3, 224, 224]}, no_optimize=True)`` is ``npuc compile m -o o --input-shape x=1x3x224x224
--no-optimize``. Errors raise :class:`NpucError` with the CLI's message.
"""

import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union


__version__: str

_Path = Union[str, "os.PathLike[str]"]

class NpucError(Exception):
    """An npuc error; the message is what the `npuc` command prints after `error: `."""

def compile(
    model: Union[_Path, Sequence[_Path]],
    output: _Path,
    *,
    progress: Optional[Callable[[str], Any]] = ...,
    **options: Any,
) -> Dict[str, Any]:
    """`npuc compile MODEL... -o OUTPUT`: returns the summary (`summary` is the CLI's last line)."""

def quantize(
    model: _Path,
    output: _Path,
    scheme: str,
    *,
    progress: Optional[Callable[[str], Any]] = ...,
    **options: Any,
) -> Dict[str, Any]:
    """`npuc compile MODEL --quantize SCHEME -o OUTPUT` (calib=, calib_method=, granularity=, ...)."""

def verify(
    quantized: _Path,
    reference: _Path,
    inputs: _Path,
    *,
    progress: Optional[Callable[[str], Any]] = ...,
    **options: Any,
) -> Dict[str, Any]:
    """`npuc verify`: the `--json` report as a dict, plus `text` (the printed table)."""

def set_max_memory(size: Union[int, str, None]) -> None:
    """Memory budget for any one tensor (`npuc --max-memory`); None: the memory available."""

def set_verify_weights(on: bool) -> None:
    """Verify `.npuc` weight checksums at open (default True; False is `npuc --trust`)."""

class TensorInfo:
    """A graph input or output."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> Optional[str]:
        """numpy dtype name ("float32", "int64", ...), None when not declared."""
    @property
    def shape(self) -> Optional[List[Union[int, str, None]]]:
        """int per fixed dim, the symbol for a symbolic one, None when unknown."""

class Session:
    """A model (ONNX) or artifact (.npuc) opened as `npuc run` opens it."""

    def __init__(
        self,
        path: _Path,
        *,
        graph: Optional[str] = ...,
        threads: int = ...,
        simulate: bool = ...,
        input_shape: Optional[Mapping[str, Sequence[int]]] = ...,
        dim: Optional[Mapping[str, int]] = ...,
        optimize: bool = ...,
    ) -> None: ...
    @property
    def inputs(self) -> List[TensorInfo]: ...
    @property
    def outputs(self) -> List[TensorInfo]: ...
    @property
    def path(self) -> str: ...
    def run(self, feeds: Mapping[str, Any]) -> Dict[str, Any]:
        """{input name: array} -> {output name: np.ndarray} (lists for sequence outputs)."""

class TokenStream(Iterator[str]):
    """Text pieces of a running generation; closing or dropping it stops the generation."""

    def __iter__(self) -> "TokenStream": ...
    def __next__(self) -> str: ...
    def close(self) -> None: ...
    @property
    def result(self) -> Optional[Dict[str, Any]]: ...

class LLM:
    """An LLM (.gguf, LLM .npuc or bundle directory) loaded as `npuc generate` loads it."""

    def __init__(self, path: _Path, **options: Any) -> None:
        """options: threads, ctx, precision ("fast" | "parity" | "exact"), chat_template, variants."""
    def generate(
        self, prompt: Optional[str] = ..., *, stream: bool = ..., **options: Any
    ) -> Any:
        """Text (str), or a TokenStream with stream=True. Options as `npuc generate`:
        max_tokens, temperature, top_k, top_p, min_p, typical_p, repeat_penalty, repeat_last_n,
        presence_penalty, frequency_penalty, seed, stop, chat, no_bos, prompt_tokens."""
    def stream(self, prompt: Optional[str] = ..., **options: Any) -> TokenStream: ...
    def tokenize(self, text: str, *, chat: bool = ..., no_bos: bool = ...) -> List[int]: ...
    @property
    def last_result(self) -> Optional[Dict[str, Any]]: ...
    @property
    def vocab(self) -> int: ...
    @property
    def ctx(self) -> int: ...
