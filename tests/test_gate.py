"""The gate's rules, as a specification: hand-written reports in Trivy's JSON schema (SchemaVersion 2).

Each test is one rule. The reports are shaped exactly like `trivy image --format json` and
`trivy config --format json` output of the pinned Trivy (0.76); the dates are fixed, so an
exception's expiry is tested on both sides of its last day.
"""
from __future__ import annotations

import datetime as dt
import re
import textwrap

import pytest

from imagebuild.checks import gate
from imagebuild.core.report import GateStage, StageStatus
from imagebuild.core.source import InputError, parse_document

from .trivy_reports import CPU, DIGEST, GPU, TODAY, misconfig, os_pkgs, python_pkgs, report, secret, vuln


def scan(variant: str, *results: dict) -> gate.ImageScan:
    return gate.ImageScan(variant, f"127.0.0.1:5000/e/paddle@{DIGEST}", DIGEST,
                          tuple(gate.findings(report(*results))))


def policy(text: str = "") -> gate.Policy:
    body = "schema: 1\n" + textwrap.dedent(text)
    return gate.parse_policy(parse_document(body, "policies/vulnerabilities.yaml"))


def judge(pol: gate.Policy, *scans: gate.ImageScan, today: dt.date = TODAY, strict: bool = False) -> gate.GateResult:
    return gate.evaluate(pol, scans, today, strict=strict)


EXPAT = vuln("CVE-2024-28757", "libexpat1", "2.5.0-1+deb12u2", fixed="2.5.0-1+deb12u4")
ZLIB = vuln("CVE-2023-45853", "zlib1g", "1:1.2.13.dfsg-1", severity="CRITICAL", status="will_not_fix")
PAM = vuln("CVE-2024-22365", "libpam0g", "1.5.2-6+deb12u2", fixed="1.5.2-6+deb12u3", severity="MEDIUM")

EXPAT_EXCEPTION = """
exceptions:
  - id: CVE-2024-28757
    owner: ml-platform-security@example.com
    reason: No untrusted XML is parsed in these images.
    expires: {expires}
"""


def only_image(result: gate.GateResult) -> gate.ImageVerdict:
    assert len(result.images) == 1
    return result.images[0]


def reasons(result: gate.GateResult | gate.ImageVerdict) -> list[str]:
    """Why a verdict does not pass: the ids of its blocking findings, then its other problems."""
    images = result.images if isinstance(result, gate.GateResult) else (result,)
    return [d.finding.id for i in images for d in i.blocking] + [p for i in images for p in i.problems]


# --- reading Trivy's reports ---------------------------------------------------------------------------


def test_vulnerabilities_secrets_and_failed_checks_are_read_from_a_schema_2_report():
    found = gate.findings(report(os_pkgs(EXPAT), secret(), misconfig()))
    assert [(f.kind, f.id) for f in found] == [
        ("vulnerability", "CVE-2024-28757"), ("secret", "aws-access-key-id"), ("misconfiguration", "DS-0002")]
    expat = found[0]
    assert (expat.package, expat.installed, expat.fixed, expat.severity) == (
        "libexpat1", "2.5.0-1+deb12u2", "2.5.0-1+deb12u4", "HIGH")


def test_a_debian_vulnerability_knows_its_source_package():
    found = gate.findings(report(os_pkgs(EXPAT, sources={"libexpat1": "expat"})))
    assert found[0].source_package == "expat"


def test_a_report_of_another_schema_version_is_refused():
    with pytest.raises(gate.ReportError, match="SchemaVersion 2"):
        gate.findings({"SchemaVersion": 1, "Results": []})


def test_passed_checks_are_not_findings():
    assert gate.findings(report(misconfig(status="PASS"))) == []


def test_a_config_report_can_be_narrowed_to_one_variants_dockerfiles():
    config = report(misconfig(target="release/cpu/Dockerfile"), misconfig(target="release/gpu/Dockerfile"))
    found = gate.findings(config, targets=["base/debian12/Dockerfile", "release/cpu/Dockerfile"])
    assert [f.target for f in found] == ["release/cpu/Dockerfile"]


def test_a_check_is_also_known_by_its_older_ids():
    (check,) = gate.findings(report(misconfig("DS-0002")))
    assert set(check.aliases) >= {"AVD-DS-0002", "DS002"}


# --- the severity threshold -----------------------------------------------------------------------------


def test_a_clean_image_passes():
    result = judge(policy(), scan(CPU, os_pkgs()))
    assert result.passed and only_image(result).decisions == ()


def test_a_vulnerability_at_the_threshold_blocks_naming_package_and_fixed_version():
    image = only_image(judge(policy("severity: HIGH\n"), scan(CPU, os_pkgs(EXPAT))))
    assert not image.passed and reasons(image) == ["CVE-2024-28757"]
    (blocked,) = image.blocking
    assert (blocked.finding.id, blocked.finding.package, blocked.finding.fixed) == (
        "CVE-2024-28757", "libexpat1", "2.5.0-1+deb12u4")


def test_a_vulnerability_above_the_threshold_blocks():
    critical = vuln("CVE-2024-0001", "openssl", "3.0.20-1~deb12u2", fixed="3.0.22-1~deb12u2", severity="CRITICAL")
    result = judge(policy("severity: HIGH\n"), scan(CPU, os_pkgs(critical)))
    assert not result.passed and reasons(result) == ["CVE-2024-0001"]
    assert only_image(result).blocking[0].why == "CRITICAL is at or above HIGH; no exception"


def test_a_vulnerability_below_the_threshold_does_not_block():
    result = judge(policy("severity: HIGH\n"), scan(CPU, os_pkgs(PAM)))
    assert result.passed
    assert only_image(result).decisions[0].verdict == gate.BELOW_THRESHOLD


def test_a_lower_threshold_blocks_more():
    result = judge(policy("severity: MEDIUM\n"), scan(CPU, os_pkgs(PAM)))
    assert not result.passed and reasons(result) == ["CVE-2024-22365"]


def test_the_threshold_is_high_when_the_policy_does_not_say():
    assert policy().severity == "HIGH"
    assert judge(policy(), scan(CPU, os_pkgs(PAM))).passed
    result = judge(policy(), scan(CPU, os_pkgs(EXPAT)))
    assert not result.passed and reasons(result) == ["CVE-2024-28757"]


def test_an_unknown_severity_is_below_every_threshold_but_unknown():
    unrated = vuln("CVE-2026-0001", "tar", "1.34+dfsg-1.2+deb12u1", fixed="1.34+dfsg-1.2+deb12u2", severity="UNKNOWN")
    assert judge(policy("severity: LOW\n"), scan(CPU, os_pkgs(unrated))).passed
    result = judge(policy("severity: UNKNOWN\n"), scan(CPU, os_pkgs(unrated)))
    assert not result.passed and reasons(result) == ["CVE-2026-0001"]


def test_python_packages_are_judged_like_os_packages():
    pip = vuln("CVE-2023-5752", "pip", "23.0.1", fixed="23.3", severity="MEDIUM")
    image = only_image(judge(policy("severity: MEDIUM\n"), scan(CPU, python_pkgs(pip))))
    assert [d.finding.package for d in image.blocking] == ["pip"]


# --- ignore_unfixed ---------------------------------------------------------------------------------------


def test_an_unfixed_vulnerability_blocks_when_ignore_unfixed_is_off():
    image = only_image(judge(policy("ignore_unfixed: false\n"), scan(CPU, os_pkgs(ZLIB))))
    assert [d.finding.id for d in image.blocking] == ["CVE-2023-45853"]


def test_ignore_unfixed_is_off_unless_the_policy_turns_it_on():
    assert policy().ignore_unfixed is False


def test_an_unfixed_vulnerability_is_ignored_when_ignore_unfixed_is_on():
    image = only_image(judge(policy("ignore_unfixed: true\n"), scan(CPU, os_pkgs(ZLIB))))
    assert image.passed
    assert image.decisions[0].verdict == gate.IGNORED_UNFIXED
    assert "will_not_fix" in image.decisions[0].why


def test_ignore_unfixed_never_ignores_a_vulnerability_that_has_a_fix():
    result = judge(policy("ignore_unfixed: true\n"), scan(CPU, os_pkgs(EXPAT)))
    assert not result.passed and reasons(result) == ["CVE-2024-28757"]


# --- exceptions ---------------------------------------------------------------------------------------------


def test_a_valid_exception_lets_the_finding_pass_and_says_until_when():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-12-31"))
    image = only_image(judge(pol, scan(CPU, os_pkgs(EXPAT))))
    assert image.passed
    (excepted,) = image.excepted
    assert excepted.exception.owner == "ml-platform-security@example.com"
    assert "until 2026-12-31" in excepted.why


def test_an_exception_is_valid_through_its_expiry_day():
    pol = policy(EXPAT_EXCEPTION.format(expires=TODAY.isoformat()))
    assert judge(pol, scan(CPU, os_pkgs(EXPAT)), today=TODAY).passed


def test_an_exception_is_expired_the_day_after_and_blocks_its_finding_again():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-06-14"))
    image = only_image(judge(pol, scan(CPU, os_pkgs(EXPAT)), today=TODAY))
    assert not image.passed
    (blocked,) = image.blocking
    assert "expired on 2026-06-14" in blocked.why
    assert any("expired on 2026-06-14" in p for p in image.problems)


def test_an_expired_exception_fails_the_gate_even_when_it_matches_nothing():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-01-01"))
    image = only_image(judge(pol, scan(CPU, os_pkgs())))
    assert not image.passed
    assert image.blocking == ()
    assert "CVE-2024-28757" in image.problems[0] and "renew it" in image.problems[0]


def test_a_valid_exception_beside_an_expired_one_excepts_the_finding_but_the_expired_one_still_fails():
    pol = policy("""
        exceptions:
          - {id: CVE-2024-28757, packages: [libexpat1], owner: a@example.com, reason: old acceptance of the risk, expires: 2026-01-01}
          - {id: CVE-2024-28757, owner: b@example.com, reason: renewed acceptance of the risk, expires: 2026-12-31}
        """)
    image = only_image(judge(pol, scan(CPU, os_pkgs(EXPAT))))
    assert [d.verdict for d in image.decisions] == [gate.EXCEPTED]
    assert image.excepted[0].exception.owner == "b@example.com"
    assert not image.passed and "expired on 2026-01-01" in image.problems[0]


def test_an_exception_for_other_packages_does_not_apply():
    pol = policy("""
        exceptions:
          - {id: CVE-2024-28757, packages: [libexpat1-dev], owner: a@example.com, reason: only the headers are affected, expires: 2026-12-31}
        """)
    result = judge(pol, scan(CPU, os_pkgs(EXPAT)))
    assert not result.passed and reasons(result) == ["CVE-2024-28757"]
    assert only_image(result).blocking[0].why == "HIGH is at or above HIGH; no exception"


def test_an_exception_may_name_the_debian_source_package():
    pol = policy("""
        exceptions:
          - {id: CVE-2024-28757, packages: [expat], owner: a@example.com, reason: every binary of src expat, expires: 2026-12-31}
        """)
    assert judge(pol, scan(CPU, os_pkgs(EXPAT, sources={"libexpat1": "expat"}))).passed


def test_python_package_names_compare_as_pypi_compares_them():
    typing_ext = vuln("CVE-2026-0002", "typing_extensions", "4.16.0", fixed="4.17.0")
    pol = policy("""
        exceptions:
          - {id: CVE-2026-0002, packages: [Typing-Extensions], owner: a@example.com, reason: not reachable from paddle, expires: 2026-12-31}
        """)
    assert judge(pol, scan(CPU, python_pkgs(typing_ext))).passed


def test_vulnerability_ids_compare_without_regard_to_case():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-12-31").replace("CVE-2024-28757", "cve-2024-28757"))
    assert judge(pol, scan(CPU, os_pkgs(EXPAT))).passed


def test_an_exception_for_one_variant_does_not_apply_to_another():
    pol = policy(f"""
        exceptions:
          - {{id: CVE-2024-28757, variants: [{CPU}], owner: a@example.com, reason: the CPU image parses no XML, expires: 2026-12-31}}
        """)
    result = judge(pol, scan(CPU, os_pkgs(EXPAT)), scan(GPU, os_pkgs(EXPAT)))
    assert [(i.variant, i.passed) for i in result.images] == [(CPU, True), (GPU, False)]
    assert not result.passed and reasons(result) == ["CVE-2024-28757"]


def test_an_exception_naming_only_variants_outside_the_report_is_neither_used_nor_stale():
    pol = policy("""
        exceptions:
          - {id: CVE-2024-28757, variants: [paddle3.0.0-cpu-py3.10-debian12], owner: a@example.com, reason: another matrix entirely, expires: 2026-12-31}
        """)
    result = judge(pol, scan(CPU, os_pkgs()))
    assert result.passed and result.warnings() == []
    assert result.exceptions[0].state == "out-of-scope"


def test_a_misconfiguration_can_be_excepted_by_its_check_id():
    pol = policy("""
        exceptions:
          - {id: DS-0002, owner: a@example.com, reason: the release layer sets USER in the next layer, expires: 2026-12-31}
        """)
    assert judge(pol, scan(CPU, misconfig("DS-0002"))).passed


def test_a_misconfiguration_exception_written_with_the_older_check_id_still_matches():
    pol = policy("""
        exceptions:
          - {id: DS002, owner: a@example.com, reason: written against an older trivy release, expires: 2026-12-31}
        """)
    assert judge(pol, scan(CPU, misconfig("DS-0002"))).passed


def test_an_exception_with_packages_never_matches_a_misconfiguration():
    pol = policy("""
        exceptions:
          - {id: DS-0002, packages: [bash], owner: a@example.com, reason: packages narrow to packages only, expires: 2026-12-31}
        """)
    result = judge(pol, scan(CPU, misconfig("DS-0002")))
    assert not result.passed and reasons(result) == ["DS-0002"]


# --- stale exceptions ------------------------------------------------------------------------------------


def test_a_stale_exception_warns_but_does_not_fail():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-12-31"))
    result = judge(pol, scan(CPU, os_pkgs(PAM)))
    assert result.passed
    assert result.exceptions[0].state == "stale"
    assert "stale exception for CVE-2024-28757" in result.warnings()[0]


def test_a_stale_exception_fails_with_strict():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-12-31"))
    image = only_image(judge(pol, scan(CPU, os_pkgs(PAM)), strict=True))
    assert not image.passed and "stale exception" in image.problems[0]


def test_an_exception_matching_a_finding_below_the_threshold_is_not_stale():
    pol = policy("""
        exceptions:
          - {id: CVE-2024-22365, owner: a@example.com, reason: pam_namespace is not configured here, expires: 2026-12-31}
        """)
    result = judge(pol, scan(CPU, os_pkgs(PAM)), strict=True)
    assert result.passed and result.exceptions[0].state == "active"


def test_an_exception_used_by_one_variant_is_not_stale_for_the_others():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-12-31"))
    result = judge(pol, scan(CPU, os_pkgs(EXPAT)), scan(GPU, os_pkgs()), strict=True)
    assert result.passed
    assert result.exceptions[0].matched == (CPU,)


def test_an_expired_exception_is_reported_as_expired_not_stale():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-01-01"))
    assert judge(pol, scan(CPU, os_pkgs())).exceptions[0].state == "expired"


# --- secrets ------------------------------------------------------------------------------------------------


def test_a_secret_blocks():
    image = only_image(judge(policy(), scan(CPU, secret())))
    (blocked,) = image.blocking
    assert blocked.finding.kind == "secret"
    assert "home/paddle/.aws/credentials:2" in blocked.why


def test_a_secret_blocks_whatever_its_severity_and_the_threshold():
    result = judge(policy("severity: CRITICAL\n"), scan(CPU, secret(severity="LOW")))
    assert not result.passed and reasons(result) == ["aws-access-key-id"]


def test_a_secret_cannot_be_excepted():
    pol = policy("""
        exceptions:
          - {id: aws-access-key-id, owner: a@example.com, reason: it is only a test key really, expires: 2026-12-31}
        """)
    result = judge(pol, scan(CPU, secret()))
    assert not result.passed and reasons(result) == ["aws-access-key-id"]
    assert "secrets cannot be excepted" in only_image(result).blocking[0].why
    assert result.exceptions[0].state == "stale"


# --- misconfigurations ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("severity", ["HIGH", "CRITICAL"])
def test_a_high_or_critical_misconfiguration_blocks(severity):
    result = judge(policy(), scan(CPU, misconfig(severity=severity)))
    assert not result.passed and reasons(result) == ["DS-0002"]


@pytest.mark.parametrize("severity", ["LOW", "MEDIUM"])
def test_a_low_or_medium_misconfiguration_does_not(severity):
    assert judge(policy(), scan(CPU, misconfig(severity=severity))).passed


def test_the_misconfiguration_threshold_is_its_own():
    pol = policy("severity: LOW\nmisconfiguration_severity: CRITICAL\n")
    assert judge(pol, scan(CPU, misconfig(severity="HIGH"))).passed
    result = judge(pol, scan(CPU, os_pkgs(PAM)))
    assert not result.passed and reasons(result) == ["CVE-2024-22365"]


# --- images, scans ----------------------------------------------------------------------------------------------


def test_an_image_whose_scan_did_not_finish_blocks():
    broken = gate.ImageScan(GPU, "127.0.0.1:5000/e/paddle@" + DIGEST, DIGEST, scanned=False,
                            problem="scan failed: trivy timed out")
    result = judge(policy(), scan(CPU, os_pkgs()), broken)
    assert [i.passed for i in result.images] == [True, False]
    assert "trivy timed out" in result.images[1].problems[0]


def test_a_gate_that_saw_no_image_does_not_pass():
    result = judge(policy())
    assert not result.passed and result.images == () and reasons(result) == []


def test_each_image_is_judged_on_its_own_findings():
    result = judge(policy(), scan(CPU, os_pkgs(PAM)), scan(GPU, os_pkgs(EXPAT)))
    assert [(i.variant, i.passed) for i in result.images] == [(CPU, True), (GPU, False)]


def test_counts_say_how_each_finding_was_judged():
    pol = policy("ignore_unfixed: true\n" + EXPAT_EXCEPTION.format(expires="2026-12-31"))
    image = only_image(judge(pol, scan(CPU, os_pkgs(EXPAT, ZLIB, PAM), secret())))
    assert image.counts() == {gate.BLOCKED: 1, gate.EXCEPTED: 1, gate.IGNORED_UNFIXED: 1, gate.BELOW_THRESHOLD: 1}


# --- what sign and push ask: the gate's record ---------------------------------------------------------------

OTHER_DIGEST = "sha256:" + "cd" * 32


def gate_record(result: gate.GateResult) -> GateStage:
    return gate.stage_record(only_image(result), result)


def test_the_record_of_a_passed_gate_lets_that_very_image_through():
    record = gate_record(judge(policy(), scan(CPU, os_pkgs())))
    assert record.status is StageStatus.PASSED and record.digest == DIGEST
    assert record.refusal(DIGEST) is None


def test_the_record_of_a_failed_gate_says_what_blocks():
    record = gate_record(judge(policy(), scan(CPU, os_pkgs(EXPAT))))
    assert record.refusal(DIGEST) == "the gate did not pass (CVE-2024-28757 libexpat1)"


def test_a_gate_that_blocks_on_many_findings_names_the_first_five():
    record = GateStage(status="failed", digest=DIGEST, blocking=[{"id": f"CVE-{n}", "package": "p"} for n in range(7)],
                       problems=["not scanned: trivy timed out"])
    assert record.refusal(DIGEST) == ("the gate did not pass (CVE-0 p; CVE-1 p; CVE-2 p; CVE-3 p; CVE-4 p; "
                                      "and 3 more)")
    assert GateStage(status="failed", digest=DIGEST).refusal(DIGEST) == "the gate did not pass (failed)"


def test_a_gate_passed_on_another_digest_does_not_count():
    record = gate_record(judge(policy(), scan(CPU, os_pkgs())))
    assert record.refusal(OTHER_DIGEST) == (f"the gate judged {DIGEST}, but the image is now {OTHER_DIGEST}; "
                                            "scan and gate it again")
    assert record.refusal(None) == "not built (no digest)"


def test_the_gate_record_is_what_the_result_file_says_of_the_image():
    result = judge(policy(), scan(CPU, os_pkgs(EXPAT)))
    (image,) = gate.to_json(result)["images"]
    assert image == {"variant": CPU, **gate_record(result).to_dict()}
    assert GateStage.from_dict(gate_record(result).to_dict()) == gate_record(result)


# --- the policy file ----------------------------------------------------------------------------------------------


def test_quoted_and_unquoted_dates_are_the_same_day():
    a = policy(EXPAT_EXCEPTION.format(expires="2026-12-31"))
    b = policy(EXPAT_EXCEPTION.format(expires="'2026-12-31'"))
    assert a.exceptions[0].expires == b.exceptions[0].expires == dt.date(2026, 12, 31)


def test_severity_words_are_read_in_any_case():
    assert policy("severity: critical\n").severity == "CRITICAL"


def test_an_exception_remembers_its_line_for_messages():
    pol = policy(EXPAT_EXCEPTION.format(expires="2026-12-31"))
    assert pol.exceptions[0].line == 4


def test_the_committed_policy_is_valid():
    from pathlib import Path

    from imagebuild.core.source import load_document
    root = Path(__file__).resolve().parent.parent
    pol = gate.parse_policy(load_document(root / "policies" / "vulnerabilities.yaml", "policies/vulnerabilities.yaml"))
    assert pol.severity in ("HIGH", "CRITICAL")


def test_the_example_policy_excepts_the_unfixed_cves_of_the_fixture_db_and_no_fixed_one():
    from pathlib import Path

    from imagebuild.core.source import load_document

    from .e2e.trivydb import PERL
    root = Path(__file__).resolve().parent.parent
    pol = gate.parse_policy(load_document(root / "examples" / "local" / "policy.yaml", "examples/local/policy.yaml"))
    assert not pol.ignore_unfixed
    unfixed = os_pkgs(ZLIB, *(vuln(PERL["id"], p, "5.36.0-7+deb12u4") for p in PERL["packages"]),
                      sources={"zlib1g": "zlib", **{p: "perl" for p in PERL["packages"]}})
    today = dt.date(2027, 1, 4)
    assert judge(pol, scan(CPU, unfixed), today=today, strict=True).passed
    stale = judge(pol, scan(CPU, unfixed, os_pkgs(EXPAT, sources={"libexpat1": "expat"})), today=today, strict=True)
    assert [d.finding.id for d in stale.images[0].blocking] == ["CVE-2024-28757"]


BAD_POLICIES = [
    ("unknown top-level key", "severity: HIGH\nignore-unfixed: true\n",
     "policies/vulnerabilities.yaml:3: ignore-unfixed: unknown key (did you mean 'ignore_unfixed'?)"),
    ("missing schema", None, "policies/vulnerabilities.yaml:1: missing required key 'schema'"),
    ("unsupported schema", "", "policies/vulnerabilities.yaml:1: schema: unsupported schema 2"),
    ("misspelt severity", "severity: HIHG\n",
     "policies/vulnerabilities.yaml:2: severity: unknown severity 'HIHG' (did you mean 'HIGH'?)"),
    ("ignore_unfixed as a word", "ignore_unfixed: sometimes\n",
     "policies/vulnerabilities.yaml:2: ignore_unfixed: expected true or false, got 'sometimes'"),
    ("exceptions not a list", "exceptions: CVE-2024-28757\n",
     "policies/vulnerabilities.yaml:2: exceptions: expected a list"),
    ("exception without owner", "exceptions:\n  - id: CVE-2024-28757\n    reason: no untrusted XML here\n    expires: 2026-12-31\n",
     "policies/vulnerabilities.yaml:3: exceptions[0]: missing required key 'owner'"),
    ("exception without expiry", "exceptions:\n  - id: CVE-2024-28757\n    owner: a@example.com\n    reason: no untrusted XML here\n",
     "policies/vulnerabilities.yaml:3: exceptions[0]: missing required key 'expires'"),
    ("expiry misspelt", "exceptions:\n  - id: CVE-2024-28757\n    owner: a@example.com\n    reason: no untrusted XML here\n    expiry: 2026-12-31\n",
     "policies/vulnerabilities.yaml:6: exceptions[0].expiry: unknown key (did you mean 'expires'?)"),
    ("expiry not a date", "exceptions:\n  - id: CVE-2024-28757\n    owner: a@example.com\n    reason: no untrusted XML here\n    expires: next year\n",
     "policies/vulnerabilities.yaml:6: exceptions[0].expires: expected a date like 2027-01-31, got 'next year'"),
    ("expiry with a time", "exceptions:\n  - id: CVE-2024-28757\n    owner: a@example.com\n    reason: no untrusted XML here\n    expires: 2026-12-31 10:00:00\n",
     "policies/vulnerabilities.yaml:6: exceptions[0].expires: expected a date like 2027-01-31, not a date and time"),
    ("reason too short", "exceptions:\n  - id: CVE-2024-28757\n    owner: a@example.com\n    reason: ok\n    expires: 2026-12-31\n",
     "policies/vulnerabilities.yaml:5: exceptions[0].reason: say why the risk is accepted"),
    ("empty owner", "exceptions:\n  - id: CVE-2024-28757\n    owner: ''\n    reason: no untrusted XML here\n    expires: 2026-12-31\n",
     "policies/vulnerabilities.yaml:4: exceptions[0].owner: must not be empty"),
    ("empty package list", "exceptions:\n  - id: CVE-2024-28757\n    packages: []\n    owner: a@example.com\n    reason: no untrusted XML here\n    expires: 2026-12-31\n",
     "policies/vulnerabilities.yaml:4: exceptions[0].packages: must not be empty (leave 'packages' out"),
    ("id with a space", "exceptions:\n  - id: CVE 2024 28757\n    owner: a@example.com\n    reason: no untrusted XML here\n    expires: 2026-12-31\n",
     "policies/vulnerabilities.yaml:3: exceptions[0].id: 'CVE 2024 28757' is not a vulnerability or check id"),
    ("an exception twice", "exceptions:\n"
     "  - {id: CVE-2024-28757, owner: a@example.com, reason: no untrusted XML here, expires: 2026-12-31}\n"
     "  - {id: cve-2024-28757, owner: b@example.com, reason: no untrusted XML there, expires: 2027-12-31}\n",
     "policies/vulnerabilities.yaml:4: exceptions[1].id: duplicate exception for cve-2024-28757 with the same scope "
     "(first at line 3)"),
    ("an exception that is a string", "exceptions:\n  - CVE-2024-28757\n",
     "policies/vulnerabilities.yaml:3: exceptions[0]: expected a mapping, got 'CVE-2024-28757'"),
]


@pytest.mark.parametrize("body,expected", [(b, e) for _, b, e in BAD_POLICIES], ids=[n for n, _, _ in BAD_POLICIES])
def test_a_malformed_policy_is_one_line_naming_file_line_and_key(body, expected):
    text = "schema: 2\n" if body == "" else ("severity: HIGH\n" if body is None else "schema: 1\n" + body)
    with pytest.raises(InputError, match=f"^{re.escape(expected)}") as err:
        gate.parse_policy(parse_document(text, "policies/vulnerabilities.yaml"))
    assert "\n" not in str(err.value)
