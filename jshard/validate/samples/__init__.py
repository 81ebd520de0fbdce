"""Sample programs for the validator, one module per rule family.

Each module defines ``PROGRAMS``: a list of ``(fn, args)`` with concrete numpy ``args``. The validator
traces every program, runs it equation by equation on one device, and keeps each equation (params and
input values) as a sample of its primitive. Shapes should include dims that do not divide 2, 3 and 4,
values should include negatives, and a program may appear with several shapes.
"""

from . import contractions, elementwise, indexing, random, reductions, shapes

MODULES = (elementwise, reductions, contractions, shapes, indexing, random)
