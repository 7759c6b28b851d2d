"""What a student who copies does to hide it, as source-to-source rewrites that keep what the
code does (tests/test_classroom_similarity.py checks that they do, then that the similarity
report still names the source).

    rename(source)      every name the file binds that its callers do not need
    no_ops(source)      pass, x = x, dead `if False:` blocks, unused assignments, strings
    swap_operands(src)  a + b -> b + a (numbers only), a < b -> b > a, a == b -> b == a
    reorder(source)     neighbouring functions and methods in the reverse order,
                        neighbouring independent assignments swapped
    all_evasions(src)   the four together
"""
import ast
import builtins
import copy
import random

# what the kit's callers (check.py, the grader, the course patch) call by name
API = {"encode_e4m3", "decode_e4m3", "encode_fp16", "decode_fp16", "Bit8Compressor",
       "Bit16Compressor", "compress", "decompress", "allreduce", "HEADER_BYTES", "tensor",
       "compression", "name", "main", "__name__"}


class _Own(ast.NodeVisitor):
    def __init__(self):
        self.names, self.attrs, self.aliases = set(), set(), set()

    def visit_Name(self, node):
        if not isinstance(node.ctx, ast.Load):
            self.names.add(node.id)

    def visit_arg(self, node):
        self.names.add(node.arg)

    def visit_FunctionDef(self, node):
        self.names.add(node.name)
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        self.names.add(node.name)
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef):
                self.attrs.add(stmt.name)
            for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
                for n in ast.walk(target) if target is not None else ():
                    if isinstance(n, ast.Name):
                        self.attrs.add(n.id)
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            if "." not in alias.name:
                self.aliases.add(alias.asname or alias.name)


def rename(source, keep=API, seed=1):
    """Every own name, module alias and own attribute renamed; docstrings reworded; comments
    gone (ast.unparse keeps none)."""
    tree = ast.parse(source)
    own = _Own()
    own.visit(tree)
    rng = random.Random(seed)
    fresh = {}

    def new(name):
        if name in keep or name.startswith("__") or hasattr(builtins, name):
            return name
        if name not in fresh:
            fresh[name] = f"{rng.choice('abcdefghkmnpqrstuvwz')}{len(fresh)}_{rng.randrange(1000)}"
        return fresh[name]

    names = own.names | own.aliases
    # keywords passed to code the file does not define (functools.partial(f, fmt=...)) name
    # parameters that must keep their names
    keep = set(keep) | {kw.arg for call in ast.walk(tree) if isinstance(call, ast.Call)
                        for kw in call.keywords if kw.arg and not (
                            (isinstance(call.func, ast.Name) and call.func.id in own.names)
                            or (isinstance(call.func, ast.Attribute) and call.func.attr in own.attrs))}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id in names:
                node.id = new(node.id)
            return node

        def visit_arg(self, node):
            node.arg = new(node.arg)
            self.generic_visit(node)            # its annotation
            return node

        def visit_FunctionDef(self, node):
            node.name = new(node.name)
            _reword(node)
            self.generic_visit(node)
            return node

        def visit_ClassDef(self, node):
            node.name = new(node.name)
            _reword(node)
            self.generic_visit(node)
            return node

        def visit_Attribute(self, node):
            if node.attr in own.attrs:
                node.attr = new(node.attr)
            self.generic_visit(node)
            return node

        def visit_Call(self, node):
            callee = node.func
            own_callee = ((isinstance(callee, ast.Name) and callee.id in own.names)
                          or (isinstance(callee, ast.Attribute) and callee.attr in own.attrs))
            if own_callee:
                for kw in node.keywords:
                    if kw.arg:
                        kw.arg = new(kw.arg)
            self.generic_visit(node)
            return node

        def visit_Import(self, node):
            for alias in node.names:
                if "." not in alias.name and (alias.asname or alias.name) not in keep:
                    alias.asname = new(alias.asname or alias.name)
            return node

    _reword(tree)
    return ast.unparse(ast.fix_missing_locations(Rename().visit(tree)))


def _reword(node):
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body[0].value.value = "My own words about this part."


def no_ops(source, seed=2):
    """A no-op statement after most statements of every block."""
    tree = ast.parse(source)
    rng = random.Random(seed)
    count = [0]

    def noop(block, at, bound):
        count[0] += 1
        kind = count[0] % 5
        if kind == 0:
            return ast.Pass()
        if kind == 1 and bound:
            name = rng.choice(sorted(bound))
            return ast.Assign(targets=[ast.Name(name, ast.Store())], value=ast.Name(name, ast.Load()))
        if kind == 2 and at > 0 and not isinstance(block[at - 1], (ast.FunctionDef, ast.ClassDef)):
            return ast.If(test=ast.Constant(False), body=[copy.deepcopy(block[at - 1])], orelse=[])
        if kind == 3:
            return ast.Assign(targets=[ast.Name(f"spare_{count[0]}", ast.Store())],
                              value=ast.BinOp(ast.Constant(count[0]), ast.Mult(), ast.Constant(2)))
        return ast.Expr(ast.Constant(f"step {count[0]}"))

    def walk(node, params):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list) or not block or not isinstance(block[0], ast.stmt):
                continue
            bound, out = set(params), []
            for at, stmt in enumerate(block):
                out.append(stmt)
                for target in getattr(stmt, "targets", []):
                    if isinstance(target, ast.Name):
                        bound.add(target.id)
                if isinstance(stmt, (ast.Return, ast.Raise)) or rng.random() < 0.25:
                    continue
                out.append(noop(block, at + 1, bound))
            setattr(node, field, out)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, {a.arg for a in child.args.args + child.args.kwonlyargs})
            elif isinstance(child, ast.stmt):
                walk(child, params if not isinstance(child, ast.ClassDef) else set())

    walk(tree, set())
    return ast.unparse(ast.fix_missing_locations(tree))


def _textual(node):
    """Might this operand be bytes, a string or a list (where + is not commutative)?"""
    for n in ast.walk(node):
        if isinstance(n, (ast.List, ast.Tuple, ast.JoinedStr)):
            return True
        if isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes)):
            return True
        if isinstance(n, ast.Attribute) and n.attr in ("tobytes", "shape"):
            return True
        if isinstance(n, ast.Name) and any(w in n.id for w in ("header", "head", "raw", "bytes")):
            return True
    return False


def swap_operands(source):
    flipped = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE,
               ast.Eq: ast.Eq, ast.NotEq: ast.NotEq}

    class Swap(ast.NodeTransformer):
        def visit_BinOp(self, node):
            self.generic_visit(node)
            if isinstance(node.op, (ast.Add, ast.Mult, ast.BitOr, ast.BitAnd, ast.BitXor)) \
                    and not (_textual(node.left) or _textual(node.right)):
                node.left, node.right = node.right, node.left
            return node

        def visit_Compare(self, node):
            self.generic_visit(node)
            if len(node.ops) == 1 and type(node.ops[0]) in flipped:
                node.left, node.comparators = node.comparators[0], [node.left]
                node.ops = [flipped[type(node.ops[0])]()]
            return node

    return ast.unparse(ast.fix_missing_locations(Swap().visit(ast.parse(source))))


def _names(node):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _swappable(a, b):
    if not all(isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
               for s in (a, b)):
        return False
    return a.targets[0].id not in _names(b) and b.targets[0].id not in _names(a)


def _reversed_runs(body):
    """Each run of neighbouring function definitions in the reverse order (nothing between
    them runs, so none can need another defined first)."""
    out, run = [], []
    for stmt in body + [None]:
        if isinstance(stmt, ast.FunctionDef):
            run.append(stmt)
            continue
        out += run[::-1]
        run = []
        if stmt is not None:
            out.append(stmt)
    return out


def _swap_neighbours(body):
    at = 0
    while at + 1 < len(body):
        if _swappable(body[at], body[at + 1]):
            body[at], body[at + 1] = body[at + 1], body[at]
            at += 2
        else:
            at += 1
    return body


def reorder(source):
    """Neighbouring functions and methods in the reverse order, neighbouring independent
    assignments swapped, in the module and in every function."""
    tree = ast.parse(source)
    tree.body = _swap_neighbours(_reversed_runs(tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            node.body = _reversed_runs(node.body)
        if isinstance(node, ast.FunctionDef):
            node.body = _swap_neighbours(node.body)
    return ast.unparse(ast.fix_missing_locations(tree))


def all_evasions(source):
    return rename(no_ops(swap_operands(reorder(source))))
