"""Validate every answer before cookiecutter writes anything.

The validation functions are plain Python so tests (and local_extensions.py, which runs
them even earlier) can import this file unrendered; only the ANSWERS literal is rendered.
"""

import json
import re
import sys

SLUG_PATTERN = re.compile(r"[a-z][a-z0-9_-]*\Z")
COUNT_PROMPTS = ("num_nodes", "gpus_per_node")
AMP_CHOICES = ("bf16", "fp16", "none")
TASK_CHOICES = ("language", "vision", "tabular")
YES_NO = ("yes", "no")


def check_slug(value):
    if not isinstance(value, str) or not SLUG_PATTERN.match(value):
        return (
            f"project_slug {value!r} is not usable as a directory and package name: "
            "use lowercase letters, digits, '_' or '-', starting with a letter"
        )
    return None


def check_count(name, value):
    text = str(value).strip()
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        return f"{name} {value!r} is not a positive integer: answer 1, 2, 3, ..."
    return None


def check_amp(value):
    if value not in AMP_CHOICES:
        return f"amp {value!r} is not one of: {', '.join(AMP_CHOICES)}"
    return None


def check_task(value):
    if value not in TASK_CHOICES:
        return f"task {value!r} is not one of: {', '.join(TASK_CHOICES)}"
    return None


def check_yes_no(name, value):
    if value not in YES_NO:
        return f"{name} {value!r} is not one of: yes, no"
    return None


K8S_NAME_MAX = 40  # + "-node-0-0" (node 0's pod hostname) stays well under DNS's 63


def check_kubernetes_name(slug):
    """With kubernetes=yes the slug, '_' as '-', names the Kubernetes objects: a DNS label."""
    name = str(slug).replace("_", "-")
    if len(name) > K8S_NAME_MAX or not name[-1:].isalnum():
        return (
            f"project_slug {slug!r} cannot name Kubernetes objects (kubernetes=yes): use at most "
            f"{K8S_NAME_MAX} characters, ending with a letter or digit"
        )
    return None


def first_error(answers):
    """Return one line describing the first invalid answer, or None if all are valid."""
    checks = [check_slug(answers.get("project_slug"))]
    checks += [check_count(name, answers.get(name)) for name in COUNT_PROMPTS]
    checks.append(check_task(answers.get("task")))
    checks.append(check_amp(answers.get("amp")))
    checks.append(check_yes_no("slurm", answers.get("slurm")))
    checks.append(check_yes_no("kubernetes", answers.get("kubernetes")))
    checks.append(check_yes_no("skypilot", answers.get("skypilot")))
    if not any(checks) and answers.get("kubernetes") == "yes":
        checks.append(check_kubernetes_name(answers.get("project_slug")))
    return next((error for error in checks if error), None)


def main():
    # Rendered by cookiecutter; tojson escapes quotes, backslashes and unicode, and the
    # raw string keeps JSON escapes intact.
    answers = json.loads(
        r"""{
        "project_slug": {{ cookiecutter.project_slug | tojson }},
        "num_nodes": {{ cookiecutter.num_nodes | tojson }},
        "gpus_per_node": {{ cookiecutter.gpus_per_node | tojson }},
        "task": {{ cookiecutter.task | tojson }},
        "amp": {{ cookiecutter.amp | tojson }},
        "slurm": {{ cookiecutter.slurm | tojson }},
        "kubernetes": {{ cookiecutter.kubernetes | tojson }},
        "skypilot": {{ cookiecutter.skypilot | tojson }}
    }"""
    )
    error = first_error(answers)
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
