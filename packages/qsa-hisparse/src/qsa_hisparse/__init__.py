"""qsa-hisparse: the one name to install for serving, and the ``qsa-hisparse`` command.

It depends on every QSA HiSparse package and adds only the command line: ``qsa-hisparse demo``,
``plan``, ``launch`` and ``doctor``, each dispatched to the package that owns the job.
"""

from qsa_hisparse._cli import main
from qsa_hisparse._version import __version__

__all__ = (
    "__version__",
    # the command line
    "main",
)
