"""models/loader"""
