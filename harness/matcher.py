"""Which recipe of a target can show a fault: the matcher over any target's ``needs``/``has``/``features``.

A fault runs in the plainest recipe of its target that meets its manifest's needs; a recipe that would then
hold faults of too few subsystems gets more (``assign_recipes``), so its config tells a detector nothing.
"""

from __future__ import annotations

from faultbench import targets


class NotRunnable(ValueError):
    """No recipe of the matrix satisfies a fault's manifest."""


def _label(need: tuple[str, str], value) -> str:
    section, key = need
    return f"{section}.{key}={value}" if section else f"{key}={value}"


def unmet(manifest, recipe, target: str = "ref") -> list[str]:
    """The manifest's needs that ``recipe`` (of ``target``) does not meet, as "section.key=value" (empty: it
    can show there)."""
    stack = targets.get(target)
    return [_label(need, v) for need, v in stack.needs(manifest).items() if stack.has(recipe, need) != v]


def recipes_for(manifest, target: str = "ref") -> list[str]:
    """Every recipe of ``target`` that meets the manifest's needs, the plainest first (fewest ``features``,
    then order)."""
    stack = targets.get(target)
    recipes = stack.recipes()
    fit = [name for name, r in recipes.items() if not unmet(manifest, r, target)]
    return sorted(fit, key=lambda name: stack.features(recipes[name]))


def recipe_for(manifest, target: str = "ref") -> str:
    """The plainest recipe of ``target`` in which the fault's manifest says it shows; ``NotRunnable`` if none can.

    Only the recipe reaches the case: its detectors see the same config as the clean cases of it.
    """
    fit = recipes_for(manifest, target)
    if not fit:
        stack = targets.get(target)
        closest = min(stack.recipes().values(), key=lambda r: len(unmet(manifest, r, target)))
        wanted = ", ".join(_label(need, v) for need, v in stack.needs(manifest).items())
        raise NotRunnable(f"needs {wanted}: no {target} recipe has all of it (closest, {closest.name}, lacks "
                          f"{', '.join(unmet(manifest, closest, target))})")
    return fit[0]


MIN_SUBSYSTEMS = 3  # a recipe that holds faults holds faults of this many subsystems at least, on every target


def assign_recipes(specs: dict) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The recipes each fault runs in (of its own target), and why the others cannot run: ({fault id:
    [recipes]}, {fault id: reason}).

    A fault runs in its plainest fitting recipe (``recipe_for``). A recipe that then holds faults of fewer
    than ``MIN_SUBSYSTEMS`` subsystems would tell a detector that recognises its config where to look, so
    it also gets, one per missing subsystem, a fault of its target it can show that it does not hold yet: the
    one with the most needs (it exercises the recipe's combination), then the one run in the fewest recipes
    so far, then a fault that acts on every step, then by id.
    """
    runs, not_runnable = {}, {}
    for fault_id, spec in specs.items():
        try:
            runs[fault_id] = [recipe_for(spec.manifest, spec.target)]
        except NotRunnable as exc:
            not_runnable[fault_id] = str(exc)
    fits = {f: recipes_for(specs[f].manifest, specs[f].target) for f in runs}
    for target in dict.fromkeys(specs[f].target for f in runs):
        mine = [f for f in runs if specs[f].target == target]
        stack = targets.get(target)
        for recipe in stack.recipes():
            held = {specs[f].subsystem for f in mine if recipe in runs[f]}
            while held and len(held) < MIN_SUBSYSTEMS:
                candidates = [f for f in mine if recipe in fits[f] and specs[f].subsystem not in held]
                if not candidates:
                    break
                pick = min(candidates, key=lambda f: (-len(stack.needs(specs[f].manifest)), len(runs[f]),
                                                      specs[f].trigger != "always", f))
                runs[pick].append(recipe)
                held.add(specs[pick].subsystem)
    return runs, not_runnable
