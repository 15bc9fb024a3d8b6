"""models.toml: the shipped file, user files extending it, and one-line errors for bad ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mlxspec
from mlxspec.registry.models_toml import (
    SHIPPED_FILE,
    Defaults,
    Registry,
    RegistryError,
    load_registry,
    parse_registry_text,
)
from mlxspec.registry.register import register_proposer

ENTRY = '[models.foo]\ntarget = "owner/name"\n'
PACKAGE = Path(mlxspec.__file__).parent


@pytest.fixture(autouse=True)
def isolated_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test sees the real user's models.toml: empty XDG config, no MLXSPEC_MODELS."""
    monkeypatch.delenv("MLXSPEC_MODELS", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "mlxspec" / "models.toml"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_shipped_file_loads_with_an_offline_default():
    registry = load_registry()
    assert registry.files == (SHIPPED_FILE,)
    entry = registry.get(None)
    assert entry.name == registry.default == "smollm2-135m"
    assert entry.target == "smollm2-135m" and entry.source == SHIPPED_FILE
    names = ["prompt-lookup", "self-spec", "draft-model", "head", "auto", "lookup-head"]
    names += ["medusa", "lookahead", "suffix", "none"]
    assert entry.proposer_names == names
    head = Path(entry.proposer("head").options["path"])  # the packaged head, resolved
    assert head == PACKAGE / "heads" / "smollm2-135m" and (head / "head.json").is_file()
    assert dict(entry.proposer("prompt-lookup").options) == {
        "ngram_max": 4,
        "ngram_min": 2,
        "k_max": 64,
    }
    assert entry.proposer("self-spec").options["layers"] == 8
    draft = entry.proposer("draft-model").options
    assert (draft["draft"], draft["draft_layers"]) == ("smollm2-135m", 10)
    assert entry.proposer("auto").options["members"] == ("prompt-lookup", "draft-model")
    assert entry.proposer(None).name == "prompt-lookup"


def test_shipped_download_pairs_are_hub_ids_with_a_chain_by_default():
    registry = load_registry()
    offline = {"smollm2-135m", "gemma3-270m"}  # packaged: pulled from PyPI
    pairs = [entry for name, entry in registry.entries.items() if name not in offline]
    assert {entry.name for entry in pairs} >= {"qwen3-8b", "llama3.1-8b", "gemma3-12b"}
    assert {entry.name for entry in pairs} >= {"qwen3.5-9b", "gpt-oss-20b", "gemma4-26b-a4b"}
    for entry in pairs:
        assert entry.target.startswith("mlx-community/"), entry.name
        assert "download" in entry.description, entry.name
        drafts = [p.options["draft"] for p in entry.proposers.values() if p.kind == "draft-model"]
        assert all(draft.startswith("mlx-community/") for draft in drafts), entry.name
        if drafts:  # a draft model pays only beside prompt lookup, in a chain
            assert entry.proposer(None).kind == "chain", entry.name
    qwen35 = [entry for name, entry in registry.entries.items() if name.startswith("qwen3.5-")]
    assert qwen35 and all(entry.defaults.presence_penalty == 1.5 for entry in qwen35)  # the card's


def _model_name(hub_id: str) -> str:
    """'z-lab/Qwen3.5-9B-DFlash' -> 'qwen3.5-9b': the model a drafter or checkpoint is of."""
    name = hub_id.split("/", 1)[1].lower()
    return re.sub(r"-dflash(-b\d+)?$", "", name)


def test_shipped_drafters_and_mtp_sources_are_of_their_own_target():
    """A z-lab DFlash drafter reads the layers of the one model it was trained on, and
    `pull --mtp` copies the MTP layer of the checkpoint named as source: each must name the
    entry's own model (a 27B drafter beside a 9B target fails only on a Mac, at load)."""
    registry = load_registry()
    checked = 0
    for entry in registry.entries.values():
        for proposer in entry.proposers.values():
            if proposer.kind == "block" and proposer.options["path"].startswith("z-lab/"):
                reference = proposer.options["path"]
            elif proposer.kind == "mtp":
                reference = proposer.options["source"]
                assert reference, f"{entry.name}: an MLX conversion has no MTP tensors"
            else:
                continue
            target = entry.target.split("/", 1)[1].lower()
            model = _model_name(reference)
            assert target.startswith(f"{model}-"), f"{entry.name}: {reference} is not of {target}"
            checked += 1
    assert checked >= 7


def test_user_file_from_env_extends_overrides_and_sets_default(tmp_path, monkeypatch):
    user = write(
        tmp_path / "mine.toml",
        'default = "tiny"\n'
        '[models.tiny]\ntarget = "me/tiny"\n'
        '[models.smollm2-135m]\ntarget = "me/smol"\ndefault_proposer = "none"\n',
    )
    monkeypatch.setenv("MLXSPEC_MODELS", str(user))
    registry = load_registry()
    assert registry.files == (SHIPPED_FILE, user)
    assert registry.default == "tiny" and registry.get(None).target == "me/tiny"
    replaced = registry.get("smollm2-135m")
    # Replaced whole: the shipped proposers are gone, only the implicit fallback is left.
    assert (replaced.target, replaced.source) == ("me/smol", user)
    assert replaced.proposer_names == ["prompt-lookup", "suffix", "none"]
    assert registry.get("qwen3-8b").source == SHIPPED_FILE


def test_user_entry_without_target_extends_the_shipped_one(isolated_config, tmp_path):
    write(
        isolated_config,
        "[models.smollm2-135m.defaults]\nmax_tokens = 99\n"
        '[models.smollm2-135m.proposers.mine]\nkind = "head"\npath = "./heads/mine"\n',
    )
    shipped = parse_registry_text(SHIPPED_FILE.read_text(), SHIPPED_FILE)[0]["smollm2-135m"]
    extended = load_registry().get("smollm2-135m")
    assert extended.target == shipped.target and extended.description == shipped.description
    assert extended.proposer_names == [*shipped.proposers, "mine", "none"]
    assert extended.proposer("mine").options["path"] == str(isolated_config.parent / "heads/mine")
    assert extended.defaults.max_tokens == 99
    assert extended.defaults.context == shipped.defaults.context
    with pytest.raises(RegistryError, match="missing target"):  # a new name needs a target
        parse_registry_text("[models.newname.defaults]\nmax_tokens = 3\n", tmp_path / "x.toml")


def test_register_proposer_adds_then_replaces_its_table(isolated_config):
    write(isolated_config, '# my models\n[models.tiny]\ntarget = "me/tiny"\n')
    register_proposer("smollm2-135m", "head", {"kind": "head", "path": "/a"}, "first")
    register_proposer("smollm2-135m", "head", {"kind": "head", "path": "/b"}, "second")
    text = isolated_config.read_text()
    assert text.startswith("# my models") and text.count("proposers.head]") == 1
    registry = load_registry()
    assert registry.get("smollm2-135m").proposer("head").options["path"] == "/b"
    assert registry.get("tiny").target == "me/tiny"
    with pytest.raises(RegistryError):  # an invalid result is refused, the file kept
        register_proposer("smollm2-135m", "head", {"kind": "head"}, "broken")
    assert isolated_config.read_text() == text


def test_user_file_from_xdg_config_dir(isolated_config):
    write(isolated_config, '[models.tiny]\ntarget = "me/tiny"\n')
    registry = load_registry()
    assert registry.files == (SHIPPED_FILE, isolated_config)
    assert registry.get("tiny").source == isolated_config
    assert registry.default == "smollm2-135m"  # the user file did not set one


def test_explicit_user_file_beats_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSPEC_MODELS", str(write(tmp_path / "env.toml", ENTRY)))
    explicit = write(tmp_path / "explicit.toml", '[models.bar]\ntarget = "owner/bar"\n')
    registry = load_registry(explicit)
    assert "bar" in registry.entries and "foo" not in registry.entries


def test_env_naming_a_missing_file_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "nope.toml"))
    with pytest.raises(RegistryError, match="MLXSPEC_MODELS names a missing file") as error:
        load_registry()
    assert str(tmp_path / "nope.toml") in str(error.value)


def test_local_paths_resolve_against_the_toml_folder(tmp_path):
    user = write(
        tmp_path / "conf" / "models.toml",
        '[models.foo]\ntarget = "./weights/big"\n'
        '[models.foo.proposers.draft-model]\ndraft = "../drafts/small"\n'
        '[models.bar]\ntarget = "~/models/bar"\n'
        '[models.baz]\ntarget = "/abs/baz"\n',
    )
    registry = load_registry(user)
    assert registry.get("foo").target == str(tmp_path / "conf" / "weights" / "big")
    assert registry.get("foo").proposer("draft-model").options["draft"] == str(
        tmp_path / "drafts" / "small"
    )
    assert registry.get("bar").target == str(Path.home() / "models" / "bar")
    assert registry.get("baz").target == "/abs/baz"


def test_proposer_lookup_default_none_and_unknown(tmp_path):
    entries, _ = parse_registry_text(
        ENTRY + 'default_proposer = "self-spec"\n[models.foo.proposers.self-spec]\nlayers = 4\n',
        tmp_path / "models.toml",
    )
    entry = entries["foo"]
    assert entry.proposer(None).name == "self-spec"
    assert entry.proposer("none") is None
    with pytest.raises(RegistryError) as error:
        entry.proposer("eagle")
    message = str(error.value)
    assert "unknown proposer 'eagle' for model 'foo'" in message
    assert message.endswith("available: self-spec, prompt-lookup, suffix, none")
    assert "models.toml" not in message  # a typo on the command line is not the file's fault


def test_default_proposer_none_means_no_speculation(tmp_path):
    entries, _ = parse_registry_text(ENTRY + 'default_proposer = "none"\n', tmp_path / "m.toml")
    assert entries["foo"].proposer(None) is None


def test_every_entry_gets_an_implicit_prompt_lookup_and_builtin_defaults(tmp_path):
    entries, default = parse_registry_text(ENTRY, tmp_path / "models.toml")
    entry = entries["foo"]
    assert default is None
    assert entry.default_proposer == "prompt-lookup" and entry.proposer_names[-1] == "none"
    lookup = entry.proposer(None)
    assert (lookup.kind, dict(lookup.options)) == (
        "prompt-lookup",
        {"ngram_max": 4, "ngram_min": 2, "k_max": 32},
    )
    assert entry.defaults == Defaults()


def test_partial_defaults_keep_builtin_values_and_ints_become_floats(tmp_path):
    text = ENTRY + "[models.foo.defaults]\ntemperature = 1\nmax_tokens = 64\n"
    defaults = parse_registry_text(text, tmp_path / "models.toml")[0]["foo"].defaults
    assert defaults == Defaults(temperature=1.0, max_tokens=64)
    assert isinstance(defaults.temperature, float)


def test_tree_defaults_parse_and_flags_override_them_for_every_entry(tmp_path):
    text = ENTRY + "[models.foo.defaults]\ntree = true\ntree_nodes = 12\n"
    entries = parse_registry_text(text, tmp_path / "models.toml")[0]
    assert entries["foo"].defaults == Defaults(tree=True, tree_nodes=12)
    with pytest.raises(RegistryError, match="tree in .* must be true or false, got a string"):
        parse_registry_text(ENTRY + '[models.foo.defaults]\ntree = "yes"\n', tmp_path / "m.toml")
    registry = Registry(entries, "foo", ())
    assert registry.with_defaults(tree=None) is registry
    assert registry.with_defaults(tree=False).get("foo").defaults.tree is False


def test_chat_template_arguments_are_a_table_and_the_server_flag_replaces_them(tmp_path):
    text = ENTRY + "[models.foo.defaults]\nchat_template_kwargs = { enable_thinking = false }\n"
    entries = parse_registry_text(text, tmp_path / "models.toml")[0]
    assert entries["foo"].defaults.chat_template_kwargs == {"enable_thinking": False}
    assert Defaults().chat_template_kwargs == {}
    with pytest.raises(RegistryError, match="kwargs in .* must be a table, .*, got a string"):
        bad = ENTRY + '[models.foo.defaults]\nchat_template_kwargs = "thinking"\n'
        parse_registry_text(bad, tmp_path / "m.toml")
    registry = Registry(entries, "foo", ()).with_defaults(chat_template_kwargs={"x": 1})
    assert registry.get("foo").defaults.chat_template_kwargs == {"x": 1}


def test_unknown_model_names_the_known_ones_and_the_user_file(isolated_config):
    with pytest.raises(RegistryError) as error:
        load_registry().get("gpt-5")
    message = str(error.value)
    assert message.startswith("unknown model 'gpt-5'; known: smollm2-135m, gemma3-270m, qwen3-8b")
    assert f"(add it to {isolated_config})" in message
    assert message.endswith(
        "or pass a hub repo id (owner/name), a local path, or a model `mlxspec models` found "
        "on this disk (hf:..., lmstudio:..., ollama:...)"
    )


def _proposer(name: str, body: str) -> str:
    return ENTRY + f"[models.foo.proposers.{name}]\n{body}\n"


BROKEN = [
    # (id, file text, whether the message names entry 'foo', the specific problem)
    ("syntax", ENTRY + "description =\n", False, "invalid TOML: Invalid value (at line 3"),
    ("top-level key", 'defualt = "foo"\n', False, "unknown top-level key 'defualt'"),
    ("default type", "default = 1\n", False, "default must be a model name (a string)"),
    ("default missing", 'default = "nope"\n' + ENTRY, False, "default = 'nope' names no entry"),
    ("models type", "models = 3\n", False, "[models] must be a table, got an integer"),
    ("entry type", 'models.foo = "x"\n', True, "[models.foo] must be a table, got a string"),
    ("entry name", '[models."my model"]\ntarget = "a/b"\n', False, "model name 'my model'"),
    ("entry key", ENTRY + 'targt = "x"\n', True, "unknown key 'targt' in [models.foo]; known"),
    ("no target", '[models.foo]\ndescription = "x"\n', True, "[models.foo] is missing target"),
    ("target type", "[models.foo]\ntarget = 3\n", True, "target in [models.foo] must be"),
    ("target form", '[models.foo]\ntarget = "a/b/c"\n', True, "'a/b/c' is neither a hub repo"),
    (
        "defaults key",
        ENTRY + "[models.foo.defaults]\ntempreature = 0.5\n",
        True,
        "unknown key 'tempreature' in [models.foo.defaults]; "
        "known keys: temperature, top_p, top_k, presence_penalty, frequency_penalty, max_tokens",
    ),
    ("defaults type", ENTRY + "defaults = 1\n", True, "[models.foo.defaults] must be a table"),
    (
        "kv bits",
        ENTRY + "[models.foo.defaults]\nkv_bits = 5\n",
        True,
        "kv_bits in [models.foo.defaults] must be 4 or 8 (KV cache quantization), got 5",
    ),
    (
        "bool is not an int",
        ENTRY + "[models.foo.defaults]\nmax_tokens = true\n",
        True,
        "max_tokens in [models.foo.defaults] must be an integer >= 1, got a boolean",
    ),
    (
        "float is not an int",
        ENTRY + "[models.foo.defaults]\ntop_k = 1.5\n",
        True,
        "top_k in [models.foo.defaults] must be an integer >= 0 (0 = off), got a number",
    ),
    (
        "top_p range",
        ENTRY + "[models.foo.defaults]\ntop_p = 0\n",
        True,
        "top_p in [models.foo.defaults] must be a number > 0 and <= 1, got 0.0",
    ),
    (
        "penalty range",
        ENTRY + "[models.foo.defaults]\npresence_penalty = 1.5\nfrequency_penalty = -2.5\n",
        True,
        "frequency_penalty in [models.foo.defaults] must be a number from -2 to 2 (0 = off), "
        "got -2.5",
    ),
    ("temperature", ENTRY + "[models.foo.defaults]\ntemperature = -1\n", True, "got -1.0"),
    ("nan", ENTRY + "[models.foo.defaults]\ntemperature = nan\n", True, "got nan"),
    ("context", ENTRY + "[models.foo.defaults]\ncontext = 0\n", True, "context in [models.foo"),
    ("proposers type", ENTRY + "proposers = []\n", True, "[models.foo.proposers] must be a"),
    ("kind", _proposer("fast", 'kind = "telepathy"'), True, "has kind 'telepathy'; set kind = one"),
    ("no kind", _proposer("fast", "layers = 4"), True, "proposers.fast] has no kind; set"),
    ("kind type", _proposer("fast", "kind = []"), True, "has kind []; set kind = one of"),
    ("reserved", _proposer("none", 'kind = "self-spec"'), True, "'none' is reserved"),
    (
        "misnamed kind",
        _proposer("self-spec", 'kind = "chain"'),
        True,
        "named after kind 'self-spec' but has kind 'chain'; rename it",
    ),
    (
        "option of another kind",
        _proposer("self-spec", "layers = 4\nngram_max = 3"),
        True,
        "unknown key 'ngram_max' in [models.foo.proposers.self-spec]; "
        "known keys: layers, exit, k_max, kind",
    ),
    ("no layers", _proposer("self-spec", ""), True, "self-spec] is missing layers; add"),
    ("no draft", _proposer("draft-model", ""), True, "draft-model] is missing draft"),
    (
        "draft_layers",
        _proposer("d", 'kind="draft-model"\ndraft="a/b"\ndraft_layers=0'),
        True,
        "draft_layers in [models.foo.proposers.d] must be an integer >= 1, got 0",
    ),
    ("no head path", _proposer("eagle", 'kind = "head"'), True, "eagle] is missing path"),
    ("k_max", _proposer("prompt-lookup", "k_max = 0"), True, "k_max in [models.foo.proposers"),
    (
        "ngram order",
        _proposer("prompt-lookup", "ngram_min = 5"),
        True,
        "ngram_min (5) in [models.foo.proposers.prompt-lookup] must be <= ngram_max (4)",
    ),
    (
        "default_proposer",
        ENTRY + 'default_proposer = "self-spec"\n',
        True,
        "default_proposer 'self-spec' is not one of its proposers; "
        "use one of: prompt-lookup, suffix, none",
    ),
    ("no members", _proposer("auto", 'kind = "chain"'), True, "auto] is missing members"),
    (
        "empty chain",
        _proposer("auto", 'kind="chain"\nmembers=[]'),
        True,
        "non-empty list of proposer names, got []",
    ),
    ("member type", _proposer("auto", 'kind="chain"\nmembers=[1]'), True, "got [1]"),
    (
        "unknown member",
        _proposer("auto", 'kind = "chain"\nmembers = ["draft-model"]'),
        True,
        "names unknown proposer 'draft-model'; define it or use one of: prompt-lookup",
    ),
    ("self member", _proposer("auto", 'kind="chain"\nmembers=["auto"]'), True, "lists itself"),
    (
        "nested chain",
        _proposer("a", 'kind="chain"\nmembers=["prompt-lookup"]')
        + '[models.foo.proposers.b]\nkind="chain"\nmembers=["a"]\n',
        True,
        "lists chain 'a'; a chain cannot nest",
    ),
    (
        "twice",
        _proposer("auto", 'kind="chain"\nmembers=["prompt-lookup", "prompt-lookup"]'),
        True,
        "lists 'prompt-lookup' twice",
    ),
]


@pytest.mark.parametrize(
    ("text", "names_entry", "problem"),
    [case[1:] for case in BROKEN],
    ids=[case[0] for case in BROKEN],
)
def test_broken_user_file_gives_one_line_naming_file_entry_and_problem(
    tmp_path, text, names_entry, problem
):
    user = write(tmp_path / "models.toml", text)
    with pytest.raises(RegistryError) as error:
        load_registry(user)
    message = str(error.value)
    assert message.startswith(f"models.toml ({user}): ")
    assert ("entry 'foo'" in message) is names_entry
    assert problem in message
    assert "\n" not in message


def test_unreadable_file_is_a_registry_error(tmp_path):
    user = tmp_path / "models.toml"
    user.write_bytes(b'[models.foo]\ntarget = "\xff"\n')
    with pytest.raises(RegistryError, match=r"models\.toml \(.*\): cannot read it"):
        load_registry(user)


def test_quoted_names_with_dots_are_named_as_written_in_toml(tmp_path):
    text = '[models."qwen2.5-7b"]\ntarget = "a/b"\n[models."qwen2.5-7b".defaults]\ntop_k = -1\n'
    with pytest.raises(RegistryError, match=r'top_k in \[models\."qwen2\.5-7b"\.defaults\]'):
        parse_registry_text(text, tmp_path / "models.toml")
