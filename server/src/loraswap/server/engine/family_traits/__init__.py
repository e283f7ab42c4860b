"""One module per served family, each declaring its FamilyTraits; engine/families.py is their table."""
