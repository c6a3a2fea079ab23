"""Not vattn's command line: `python -m vattn` runs this file when started in the directory that holds a checkout.

A checkout is a folder named ``vattn`` (``git clone`` names it so). Python
started in the directory that holds it looks there first (the current
directory comes first on ``sys.path``) and, with vattn installed in editable
mode (the README's install) or not at all, imports that folder as an empty
namespace package: ``import vattn`` then succeeds and the first use fails far
from the cause (``module 'vattn' has no attribute 'KVCacheManager'``), and
``python -m vattn`` runs this file.
Nothing runs on a plain ``import vattn`` there, so only this command can say
why; README's Quick start says it for scripts. (An ``__init__.py`` here would
be run by pytest, which imports the checkout's top folder as a package.)
"""

import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.exit(f"python -m vattn: Python found {here}, the root of a vattn checkout, as `vattn`, because it was started "
         f"in the directory that holds it ({Path.cwd()}), which comes first on sys.path; the package is "
         f"{here / 'vattn'}. Start Python in another directory (or inside the checkout): `import vattn` here "
         f"fails the same way, as \"module 'vattn' has no attribute ...\".")
