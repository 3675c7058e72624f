"""The memory core's shape (issue 25): no class more than two levels below its interface --
``MemoryManager`` for the managers, ``KVCache`` for the caches. Mixins (rules, tenants, units)
sit beside the core class; they are not levels."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from vmemkv.runtime import cache as cache_package
from vmemkv.runtime.cache.base import KVCache
from vmemkv.scheduler import managers as manager_package
from vmemkv.scheduler.managers.base import MemoryManager


def classes_below(package, interface) -> list:
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if c.__module__ == module.__name__ and issubclass(c, interface)
                  and c is not interface]
    return found


def depth_below(cls, interface) -> int:
    """The longest chain of interface subclasses from ``cls`` up to ``interface``."""
    if cls is interface:
        return 0
    return 1 + max(depth_below(base, interface) for base in cls.__bases__
                   if issubclass(base, interface))


@pytest.mark.parametrize("package, interface", [(manager_package, MemoryManager),
                                                (cache_package, KVCache)])
def test_no_class_is_more_than_two_levels_below_its_interface(package, interface):
    classes = classes_below(package, interface)
    assert classes, "no class found: the walk is broken"
    deep = {c.__name__: depth_below(c, interface) for c in classes
            if depth_below(c, interface) > 2}
    assert deep == {}
