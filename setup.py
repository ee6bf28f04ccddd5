"""The one compiled part: the staged reader (loader/io/_staged.c), built where a C compiler is present.

It is optional: where it does not build, the install goes on and the pinned and cufile readers use kvikio's
engine and the Python ring for cached files, as they say in their reports. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gdsload.loader.io._staged",
            ["loader/io/_staged.c"],
            libraries=["dl", "pthread"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
)
