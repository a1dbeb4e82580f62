"""The webhook image's pure parts (release/admission_image.py): its pins, its build context and its key,
its Dockerfile, and the bad input the command refuses before it builds anything.

The e2e test (tests/e2e/test_admission_image.py) builds, smoke-tests, scans and signs it for real.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from imagebuild.admission.policies import RUN_AS_USER
from imagebuild.build.plan import Root
from imagebuild.config.trust import load_trust_config
from imagebuild.core.source import InputError
from imagebuild.release import admission_image as webhook

from .conftest import REPO_ROOT, run_imagebuild

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency below 3.11
    import tomli as tomllib

DIGEST = "sha256:" + "a" * 64
OTHER_DIGEST = "sha256:" + "b" * 64
ROOT = Root("127.0.0.1:5000/imagebuild/debian:12", DIGEST, pinned=False)
IMAGE = webhook.WebhookImage("127.0.0.1:5000", "imagebuild", "admission", "local")
PINNED = {canonicalize_name(pin.name): pin for pin in webhook.WEBHOOK_REQUIREMENTS}
# The modules `imagebuild admission serve` runs on: the command, the server, and what a review calls.
WEBHOOK_MODULES = ("imagebuild.cli", "imagebuild.cli.admission_command", "imagebuild.admission.server",
                   "imagebuild.admission.review", "imagebuild.admission.quarantine", "imagebuild.trust.verify",
                   "imagebuild.oci.client", "imagebuild.oci.auth", "imagebuild.config.trust")


def test_the_image_runs_as_the_user_the_deployment_names():
    assert (webhook.USER.uid, webhook.USER.gid) == (RUN_AS_USER, RUN_AS_USER)


# --- the pins ------------------------------------------------------------------------------------


def pyproject_dependencies() -> dict[str, Requirement]:
    data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return {canonicalize_name(r.name): r for r in map(Requirement, data["project"]["dependencies"])}


def distributions_the_webhook_imports() -> set[str]:
    """The distributions whose modules a fresh interpreter has loaded after importing the webhook's modules."""
    program = textwrap.dedent(f"""
        import importlib, importlib.metadata, json, sys
        before = set(sys.modules)  # the interpreter's own start-up (site's .pth hooks) is not the webhook's
        for name in {WEBHOOK_MODULES!r}:
            importlib.import_module(name)
        owners = importlib.metadata.packages_distributions()
        tops = {{name.split(".")[0] for name in set(sys.modules) - before}} - set(sys.stdlib_module_names) - {{"imagebuild"}}
        print(json.dumps(sorted({{d for top in tops for d in owners.get(top, [])}})))
    """)
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    return {canonicalize_name(name) for name in json.loads(proc.stdout)}


def test_every_distribution_the_webhook_imports_is_pinned_and_the_build_side_is_not():
    imported = distributions_the_webhook_imports()
    # cryptography tries bcrypt for OpenSSH keys when it is there (the tests install it); the webhook reads none.
    imported.discard("bcrypt")
    # httpx tries zstandard (zstd Content-Encoding) when it is there (the build side installs it for zstd layers);
    # registries do not answer in zstd, so the webhook image goes without it.
    imported.discard("zstandard")
    assert imported <= set(PINNED), f"imported but not pinned: {sorted(imported - set(PINNED))}"
    assert {"click", "pyyaml", "httpx", "cryptography", "h11", "prometheus-client"} <= imported
    assert not {"docker", "jinja2", "rich", "isal"} & set(PINNED)


def test_each_pin_of_a_direct_dependency_is_inside_pyprojects_range():
    declared = pyproject_dependencies()
    direct = {name for name in PINNED if name in declared}
    assert direct == {"click", "pyyaml", "httpx", "cryptography", "h11", "prometheus-client"}
    outside = [f"{name}=={PINNED[name].version} (pyproject: {declared[name].specifier})"
               for name in sorted(direct) if not declared[name].specifier.contains(PINNED[name].version)]
    assert outside == []


def test_the_pins_are_closed_under_their_own_requirements():
    """What each pinned distribution requires on CPython 3.11 on Linux is pinned too (read from the
    installed metadata): pip --require-hashes would refuse anything else at build time."""
    import importlib.metadata

    env = {**default_environment(), "python_version": "3.11", "python_full_version": "3.11.2",
           "sys_platform": "linux", "platform_system": "Linux", "platform_python_implementation": "CPython",
           "implementation_name": "cpython", "extra": ""}
    missing = set()
    for name in PINNED:
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(env):
                missing |= {canonicalize_name(requirement.name)} - set(PINNED)
    assert missing == set()


def test_each_pin_is_one_exact_version_and_one_sha256():
    for pin in (*webhook.WEBHOOK_REQUIREMENTS, *webhook.BUILD_REQUIREMENTS):
        assert re.fullmatch(r"[0-9a-f]{64}", pin.sha256), pin
        assert pin.line() == f"{pin.name}=={pin.version} --hash=sha256:{pin.sha256}\n"
    assert len(PINNED) == len(webhook.WEBHOOK_REQUIREMENTS)
    build = Requirement(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["build-system"]["requires"][0])
    assert build.specifier.contains(webhook.BUILD_REQUIREMENTS[0].version)


# --- the build context and its hash ------------------------------------------------------------------


def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "imagebuild" / "data").mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'imagebuild'\n")
    (root / "imagebuild" / "__init__.py").write_text("")
    (root / "imagebuild" / "data" / "support.yaml").write_text("x: 1\n")
    return root


def test_the_context_is_pyproject_and_the_package_without_caches(tmp_path):
    root = checkout(tmp_path)
    (root / "imagebuild" / "__pycache__").mkdir()
    (root / "imagebuild" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / "imagebuild" / "stray.pyc").write_bytes(b"\0")
    (root / "README.md").write_text("not part of the package's source")
    (root / "tests").mkdir()
    (root / "tests" / "test_x.py").write_text("")
    files = webhook.context_files(root)
    assert sorted(files) == ["imagebuild/__init__.py", "imagebuild/data/support.yaml", "pyproject.toml",
                             "requirements-build.txt", "requirements.txt"]
    assert files["requirements.txt"].decode() == webhook.requirements_text(webhook.WEBHOOK_REQUIREMENTS)


@pytest.mark.parametrize("link", ["file", "folder"])
def test_a_link_in_the_package_is_refused_not_followed(tmp_path, link):
    root = checkout(tmp_path)
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "id_rsa").write_text("private")
    target = outside / "id_rsa" if link == "file" else outside
    (root / "imagebuild" / "leak").symlink_to(target)
    with pytest.raises(InputError, match="imagebuild/leak: --source: is a link or not a regular file"):
        webhook.source_files(root)


def test_a_folder_that_is_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(InputError, match="--source: is not an imagebuild checkout"):
        webhook.source_files(tmp_path)


def test_the_tree_hash_changes_with_any_byte_name_or_file_and_not_with_order():
    files = {"pyproject.toml": b"a", "imagebuild/x.py": b"b"}
    base = webhook.tree_sha256(files)
    assert webhook.tree_sha256(dict(reversed(list(files.items())))) == base
    assert webhook.tree_sha256({**files, "imagebuild/x.py": b"c"}) != base
    assert webhook.tree_sha256({"pyproject.toml": b"a", "imagebuild/y.py": b"b"}) != base
    assert webhook.tree_sha256({**files, "imagebuild/new.py": b""}) != base
    # A path cannot run into the content before it: the separators keep the two apart.
    assert webhook.tree_sha256({"ab": b"c"}) != webhook.tree_sha256({"a": b"bc"})


def test_the_real_checkout_gives_a_context_that_follows_its_source():
    files = webhook.context_files(REPO_ROOT)
    assert "imagebuild/admission/server.py" in files and "imagebuild/templates/admission.Dockerfile.j2" in files
    assert not [path for path in files if path.startswith(("tests/", "smoke_tests/")) or "__pycache__" in path]


# --- the plan and its Dockerfile -----------------------------------------------------------------


def key(image=IMAGE, root=ROOT, source="1" * 64) -> str:
    return next(iter(webhook.admission_plan(image, root, source).layers))


def test_the_key_changes_exactly_when_the_image_would():
    assert key() == key()
    assert key(source="2" * 64) != key()
    assert key(root=Root(ROOT.image, OTHER_DIGEST, pinned=False)) != key()
    assert key(image=webhook.WebhookImage("127.0.0.1:5000", "imagebuild", "admission", "0.2.0")) != key()
    # Where the registry is does not change the image: the same key in staging and in CI's registry.
    assert key(image=webhook.WebhookImage("10.0.0.1:5000", "imagebuild", "admission", "local")) == key()


def test_the_plan_is_one_variant_of_one_layer_tagged_as_the_trust_file_says():
    plan = webhook.admission_plan(IMAGE, ROOT, "1" * 64)
    (variant,) = plan.variants
    (layer,) = plan.layers.values()
    assert variant.chain == (layer.key,) and variant.tags == ("local",) and variant.id == webhook.VARIANT_ID
    assert plan.repository_ref == "127.0.0.1:5000/imagebuild/admission"
    assert plan.cache_ref == "127.0.0.1:5000/imagebuild/admission-layers"
    assert layer.path == "admission/debian12" and layer.parent is None
    assert dict(layer.build_args) == {"IMAGEBUILD_BASE": f"{ROOT.image}@{DIGEST}", "IMAGEBUILD_BASE_DIGEST": DIGEST}


def instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def stages(dockerfile: str) -> list[list[str]]:
    out: list[list[str]] = []
    for line in instructions(dockerfile):
        if line.startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def test_the_final_stage_is_non_root_shell_free_and_exec_form():
    dockerfile = webhook.render_dockerfile(IMAGE, ROOT, "1" * 64)
    build, final = stages(dockerfile)
    assert build[0] == "FROM ${IMAGEBUILD_BASE} AS build" and final[0] == "FROM ${IMAGEBUILD_BASE}"
    runs = [line for line in final if line.startswith("RUN ")]
    last_run = runs[-1]
    assert "find / -xdev -perm /6000 -type f -exec chmod ug-s {} +" in last_run
    assert last_run.endswith("grep '^/' /etc/shells | xargs rm -f"), "the shells go last"
    after = final[final.index(last_run) + 1:]
    assert not [line for line in after if line.startswith(("RUN ", "COPY ", "ADD "))], "nothing runs once the shells are gone"
    assert "USER 65532:65532" in after
    assert after[-2:] == ['ENTRYPOINT ["/opt/venv/bin/imagebuild"]', 'CMD ["admission", "serve", "--help"]']
    assert final[-2].startswith("ENTRYPOINT [")


def test_the_ca_bundle_is_a_secret_of_exactly_the_steps_that_download():
    dockerfile = webhook.render_dockerfile(IMAGE, ROOT, "1" * 64)
    runs = [line for line in instructions(dockerfile) if line.startswith("RUN ")]
    mounting = [run for run in runs if "--mount=type=secret,id=ca-bundle,target=/run/secrets/ca-bundle" in run]
    downloading = [run for run in runs if "apt-get install" in run or "--require-hashes" in run]
    assert mounting == downloading and len(downloading) == 3
    # Offline steps: the package's own wheel comes from the context, never an index.
    assert all("--no-index" in run for run in runs if "/src/package" in run or "/src/dist" in run)
    assert "ca-bundle" not in "".join(line for line in instructions(dockerfile) if not line.startswith("RUN "))


def test_only_the_context_files_are_copied_in():
    dockerfile = webhook.render_dockerfile(IMAGE, ROOT, "1" * 64)
    copied = [line.split()[1:-1] for line in instructions(dockerfile) if line.startswith("COPY ")]
    sources = {word for words in copied for word in words if not word.startswith("--from=")}
    assert sources == {"requirements-build.txt", "requirements.txt", "pyproject.toml", "imagebuild", "/opt/venv"}
    assert "ADD " not in dockerfile


def test_the_labels_name_the_source_hash_and_the_base():
    dockerfile = webhook.render_dockerfile(IMAGE, ROOT, "f" * 64)
    assert f'io.imagebuild.source.sha256="{"f" * 64}"' in dockerfile
    assert 'org.opencontainers.image.base.digest="${IMAGEBUILD_BASE_DIGEST}"' in dockerfile
    assert 'org.opencontainers.image.version="local"' in dockerfile


def test_a_pinned_base_is_named_by_digest_in_both_stages():
    root = webhook.base_root(f"127.0.0.1:5000/imagebuild/debian:12@{DIGEST}", None)
    assert root == Root("127.0.0.1:5000/imagebuild/debian:12", DIGEST, pinned=True)
    dockerfile = webhook.render_dockerfile(IMAGE, root, "1" * 64)
    assert [s[0] for s in stages(dockerfile)] == [f"FROM {root.image}@{DIGEST} AS build", f"FROM {root.image}@{DIGEST}"]
    assert "IMAGEBUILD_BASE" not in dockerfile.replace("IMAGEBUILD_BASE_DIGEST", "")
    assert f'org.opencontainers.image.base.digest="{DIGEST}"' in dockerfile
    assert dict(next(iter(webhook.admission_plan(IMAGE, root, "1" * 64).layers.values())).build_args) == {}


@pytest.mark.parametrize(("base", "name"), [("127.0.0.1:5000/imagebuild/debian:12", "debian12"),
                                            ("registry.example.com/base/ubuntu:22.04", "ubuntu22.04"),
                                            (f"example.com/debian@{DIGEST}", "debian")])
def test_the_layer_is_named_after_its_base(base, name):
    assert webhook.layer_name(webhook.base_root(base, DIGEST)) == name


# --- the trust file's webhook.image ----------------------------------------------------------------


def trust_file(tmp_path: Path, image: str, images: list[str] | None = None) -> Path:
    path = tmp_path / "trust.yaml"
    path.write_text(yaml.safe_dump({
        "schema": 1, "keys": [{"name": "k", "path": str(REPO_ROOT / "policies" / "keys" / "imagebuild-release-2026.pub")}],
        "images": images or ["127.0.0.1:5000/imagebuild/**"], "webhook": {"image": image}}))
    return path


def image_of(path: Path) -> webhook.WebhookImage:
    return webhook.webhook_image(load_trust_config(path), str(path), 7)


def test_the_example_trust_files_webhook_image_is_covered_by_its_own_images():
    path = REPO_ROOT / "examples" / "local" / "trust.yaml"
    assert image_of(path) == IMAGE


def test_an_image_without_a_tag_is_built_to_latest(tmp_path):
    assert image_of(trust_file(tmp_path, "127.0.0.1:5000/imagebuild/admission")).tag == "latest"


@pytest.mark.parametrize(("image", "message"), [
    (f"127.0.0.1:5000/imagebuild/admission@{DIGEST}", "names a digest; imagebuild builds the webhook's image to a tag"),
    ("127.0.0.1:5000/elsewhere/admission:1", r"is not covered by the file's images \(127.0.0.1:5000/imagebuild/\*\*\)"),
    ("127.0.0.1:5000/admission:1", "needs a project in its path"),
    ("127.0.0.1:5000/Imagebuild/admission:1", "is not an image reference"),
])
def test_a_webhook_image_that_cannot_be_built_or_admitted_is_refused(tmp_path, image, message):
    path = trust_file(tmp_path, image, ["127.0.0.1:5000/imagebuild/**"])
    with pytest.raises(InputError, match=f"trust.yaml:7: webhook.image: '.* {message}"):
        image_of(path)


# --- secrets ---------------------------------------------------------------------------------------


def test_only_the_ca_bundle_can_be_handed_to_the_build(tmp_path):
    with pytest.raises(InputError, match="--secret: netrc: the webhook image's Dockerfile mounts only ca-bundle"):
        webhook.build_secrets({"netrc": str(tmp_path)})
    with pytest.raises(InputError, match="ca-bundle=/nonexistent/ca.pem: no such file"):
        webhook.build_secrets({"ca-bundle": "/nonexistent/ca.pem"})
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n")
    secrets = webhook.build_secrets({"ca-bundle": str(bundle)})
    assert secrets.paths == {"ca-bundle": str(bundle.resolve())}
    assert secrets.values == (bundle.read_text().strip(),)  # redacted from every log


# --- the command's bad input: one line, exit 2, nothing built ---------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--source", "/"], "/: --source: is not an imagebuild checkout"),
    (["--secret", "netrc=/etc/hostname"], "--secret: netrc: the webhook image's Dockerfile mounts only ca-bundle"),
    (["--offline", "--db-repository", "x/y:2"], "--db-repository: --offline uses the DB in --cache-dir"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    trust = trust_file(tmp_path, "127.0.0.1:5000/imagebuild/admission:local")
    proc = run_imagebuild("admission", "image", "--trust", trust, "--workdir", tmp_path / "w", *args,
                          env={"COSIGN_PASSWORD": ""})
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}")
    assert not (tmp_path / "w").exists()


def test_an_uncovered_webhook_image_is_refused_before_anything_is_built(tmp_path):
    trust = trust_file(tmp_path, "127.0.0.1:5000/elsewhere/admission:local")
    proc = run_imagebuild("admission", "image", "--trust", trust, "--workdir", tmp_path / "w")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "webhook.image: '127.0.0.1:5000/elsewhere/admission:local' is not covered" in proc.stderr
    assert not (tmp_path / "w").exists()


# --- the command's place under `imagebuild admission` ---------------------------------------------


def test_the_image_command_is_listed_with_its_own_short_help():
    import click

    from imagebuild.cli.admission_command import _IMAGE, admission_group

    command = admission_group.get_command(click.Context(admission_group), "image")
    assert command is not None and command.get_short_help_str(limit=10_000) == _IMAGE.short_help


def test_serving_loads_nothing_only_the_image_build_needs():
    program = textwrap.dedent("""
        import json, sys
        import click
        from imagebuild.cli.admission_command import admission_group
        assert admission_group.get_command(click.Context(admission_group), "serve") is not None
        print(json.dumps(sorted(sys.modules)))
    """)
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    loaded = set(json.loads(proc.stdout))
    assert not {"docker", "jinja2", "rich", "imagebuild.release.admission_image", "imagebuild.build.scheduler",
                "imagebuild.cli.admission_image_command"} & loaded
