"""Coverage-guided fuzzing of dlcp's C extensions against their Python twins.

`bash scripts/fuzz` builds the extensions with AddressSanitizer and
UndefinedBehaviorSanitizer (and libFuzzer's coverage counters) into
build/fuzz/lib and runs each target of `fuzz.harness.TARGETS` under atheris
(`python -m fuzz run NAME`). Every target feeds the same input to a C entry
point and to the Python form docs/native.md names for it: a sanitizer report,
a divergence (AssertionError) or any other exception is a finding.
tests/test_fuzz_targets.py runs every target over its seed corpus
(fuzz/corpus/NAME) with the normal build, so a divergence a seed shows fails
the suite even where atheris is not installed.
"""
