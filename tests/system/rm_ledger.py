"""What a trace itself says about live RM memory objects, read without the decoder.

An independent model of NVIDIA's RM object lifetimes (open-gpu-kernel-modules; facts in
../shared/nvidia-abi.md), written from the trace format alone so that the kernel decoder can be
checked against it: `RmLedger.feed(event)` follows one process's calls in order and
`live_memory()` answers which video-memory objects (class NV01_MEMORY_LOCAL_USER, 0x40) the
driver holds for it at that point. It knows:

* RM_ALLOC (NVOS21 / NVOS64, also inside IOCTL_XFER_CMD with outer size 16) answered with
  status 0 makes an object (hRoot, hObjectNew) under hObjectParent; clients (0x0/0x1/0x41)
  remember the open file they were allocated on;
* VID_HEAP_CONTROL ALLOC_SIZE of video memory (LOCATION VIDMEM, not VIRTUAL) makes a 0x40
  object; its FREE (MEMORY_HANDLE_PROVIDED) frees it;
* DUP_OBJECT makes a new handle of the source's class (RM duplicates the resource reference);
* RM_FREE frees an object and its whole subtree; freeing hRoot frees the client;
* closing the last descriptor of an open file frees every client allocated on it (dup'd
  descriptors share the file: rm_cleanup_file_private runs at the file's release);
* process exit frees everything.
RM_ALLOC_MEMORY (0x27) and IMPORT_OBJECT_FROM_FD make no video memory here (the driver's
0x27 allocates nothing for 0x40; an import is a reference whose class the call does not name).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from gpuwatch.sim.tracefile import Block, Close, Dup, Event, Exit, Ioctl, Open

MAGIC = 0x46
RM_FREE, RM_ALLOC, RM_DUP_OBJECT, RM_VID_HEAP_CONTROL, IOCTL_XFER_CMD = 0x29, 0x2B, 0x34, 0x4A, 211
CLIENT_CLASSES = (0x0, 0x1, 0x41)
VIDMEM = 0x40


@dataclass
class RmLedger:
    """One process's RM objects as the trace shows them."""

    objects: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (root, h) -> (parent, class)
    clients: dict[int, int] = field(default_factory=dict)   # hClient -> open-file id
    files: dict[int, int] = field(default_factory=dict)     # fd -> open-file id
    refs: dict[int, int] = field(default_factory=dict)      # open-file id -> descriptors
    rm_allocs: int = 0                                      # RM_ALLOC calls seen (any status)
    _next_file: int = 0

    def feed(self, event: Event) -> None:
        if isinstance(event, Open) and event.fd >= 0:
            self._next_file += 1
            self.files[event.fd] = self._next_file
            self.refs[self._next_file] = 1
        elif isinstance(event, Dup) and event.fd in self.files:
            if event.newfd in self.files:
                self._close(event.newfd)
            self.files[event.newfd] = self.files[event.fd]
            self.refs[self.files[event.fd]] += 1
        elif isinstance(event, Close) and event.fd in self.files:
            self._close(event.fd)
        elif isinstance(event, Exit):
            self.objects.clear()
            self.clients.clear()
        elif isinstance(event, Ioctl) and event.fd in self.files:
            self._ioctl(event.fd, event.cmd, event.params)

    def live_memory(self) -> set[tuple[int, int]]:
        """(hRoot, hObject) of every live 0x40 object."""
        return {key for key, (_, cls) in self.objects.items() if cls == VIDMEM}

    # ---- calls -------------------------------------------------------------------------------
    def _ioctl(self, fd: int, cmd: int, block: Block) -> None:
        if (cmd >> 8) & 0xFF != MAGIC:
            return  # nvidia-uvm: bare numbers, no RM objects
        nr, size = cmd & 0xFF, (cmd >> 16) & 0x3FFF
        if nr == IOCTL_XFER_CMD:
            if size != 16 or not block.nested:
                return  # the driver refuses any other outer size
            # the driver takes the inner cmd whole as the escape number: a full ioctl word
            # there is no escape it knows
            nr = struct.unpack_from("<I", block.after, 0)[0]
            block = block.nested[0][1]
            size = len(block.after)
        after = block.after
        if nr == RM_ALLOC and size in (32, 48):
            self.rm_allocs += 1
            h_root, h_parent, h_new, h_class = struct.unpack_from("<4I", after, 0)
            status = struct.unpack_from("<I", after, 28 if size == 32 else 40)[0]
            if status == 0:
                self._alloc(fd, h_root, h_parent, h_new, h_class)
        elif nr == RM_FREE and size == 16:
            h_root, _, h_old, status = struct.unpack_from("<4I", after, 0)
            if status == 0:
                self._free(h_root, h_old)
        elif nr == RM_DUP_OBJECT and size == 28:
            h_client, h_parent, h_new, h_client_src, h_src, _, status = struct.unpack_from("<7I", after, 0)
            source = self.objects.get((h_client_src, h_src))
            if status == 0 and source is not None:
                self.objects[(h_client, h_new)] = (h_parent, source[1])
        elif nr == RM_VID_HEAP_CONTROL and size == 184:
            h_root, h_parent, function = struct.unpack_from("<3I", after, 0)
            status = struct.unpack_from("<I", after, 20)[0]
            h_memory = struct.unpack_from("<I", after, 44)[0]
            flags, attr = struct.unpack_from("<II", after, 52)
            if status != 0:
                return
            if function == 2 and (attr >> 25) & 3 == 0 and not flags & 0x80000:
                self.objects[(h_root, h_memory)] = (h_parent, VIDMEM)
            elif function == 3 and struct.unpack_from("<I", after, 48)[0] & 1:
                self._free(h_root, h_memory)

    def _alloc(self, fd: int, h_root: int, h_parent: int, h_new: int, h_class: int) -> None:
        if h_class in CLIENT_CLASSES:
            self.clients[h_new] = self.files[fd]
        else:
            self.objects[(h_root, h_new)] = (h_parent, h_class)

    def _free(self, h_root: int, h_old: int) -> None:
        if h_old == h_root:
            self.clients.pop(h_root, None)
            for key in [k for k in self.objects if k[0] == h_root]:
                del self.objects[key]
            return
        doomed = {h_old}
        grew = True
        while grew:  # the subtree under h_old, by parent links
            grew = False
            for (root, handle), (parent, _) in self.objects.items():
                if root == h_root and parent in doomed and handle not in doomed:
                    doomed.add(handle)
                    grew = True
        for handle in doomed:
            self.objects.pop((h_root, handle), None)

    def _close(self, fd: int) -> None:
        file_id = self.files.pop(fd)
        self.refs[file_id] -= 1
        if self.refs[file_id] == 0:
            for h_client in [h for h, f in self.clients.items() if f == file_id]:
                self._free(h_client, h_client)
