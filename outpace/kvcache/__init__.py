"""kvcache"""
